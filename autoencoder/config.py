"""The autoencoder's configuration, shared by both variants; `autoencoder/train.py` adds core's flags."""
from dataclasses import dataclass

from autoencoder.data import DATASETS
from common.config import RunConfig, flag


@dataclass
class Config(RunConfig):
    dataset: str = flag("digits", "dataset (digits is embedded; fake is for smoke tests)", choices=DATASETS)
    max_steps: int = flag(2400, "optimizer steps")
    image_size: int = flag(32, "side of the square images in pixels")
    latent: int = flag(32, "size of the code between encoder and decoder (2 also plots the codes)")
    width: int = flag(32, "channels of the first convolution")
    lr_encoder: float = flag(2e-3, "Adam learning rate of the encoder's param group")
    lr_decoder: float = flag(2e-3, "Adam learning rate of the decoder's param group")

    def check(self):
        super().check()
        if self.image_size < 4 or self.image_size % 4:  # the encoder halves the side twice
            raise ValueError(f"--image-size must be a multiple of 4 from 4 up, got {self.image_size}")
        self.check_at_least(1, "latent", "width")
        self.check_at_least(0, "lr_encoder", "lr_decoder")
        self.check_fits({"--width": self.width ** 2, "--latent and --width": self.latent * self.width,
                         "--batch-size and --image-size": self.batch_size * self.image_size ** 2})
