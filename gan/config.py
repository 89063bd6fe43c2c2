"""The GAN's configuration, shared by both variants; `gan/train.py` adds core's flags to it."""
from dataclasses import dataclass

from common.config import RunConfig, flag
from gan.data import DATASETS


@dataclass
class Config(RunConfig):
    dataset: str = flag("digits", "dataset (digits is embedded; fake is for smoke tests)", choices=DATASETS)
    max_steps: int = flag(3000, "optimizer steps of each model")
    image_size: int = flag(32, "side of the square images in pixels", choices=(32, 64))
    nz: int = flag(64, "latent size (the paper's nz)")
    ngf: int = flag(32, "generator feature maps in its last hidden layer (the paper's ngf)")
    ndf: int = flag(32, "discriminator feature maps in its first layer (the paper's ndf)")
    lr: float = flag(2e-4, "Adam learning rate of both models")
    beta1: float = flag(0.5, "Adam beta1 of both models")
    sample_every: int = flag(250, "save a sample grid every N steps")
    eval_samples: int = flag(360, "generated images for the score (the digits held-out size)")

    def check(self):
        super().check()
        if self.accumulate > 1:
            raise ValueError("--accumulate: the GAN's BatchNorm layers normalise each micro-batch by its own "
                             "statistics, so N micro-batches would not train like one batch N times larger; "
                             "raise --batch-size instead")
