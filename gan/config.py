"""The GAN's configuration, shared by both variants; `gan/train.py` adds core's flags to it."""
from dataclasses import dataclass

from common.config import RunConfig, flag
from gan.augment import POLICIES, parse_policy
from gan.data import DATASETS, NATIVE_SIZE


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
    sample_every: int = flag(250, "save a sample grid every N steps (0: only at the end)")
    eval_samples: int = flag(360, "generated images for the score (the digits held-out size)")
    ema_decay: float = flag(0.999, "decay of the exponential moving average of the generator's weights, which is "
                                   "scored beside the raw generator (0: no average)")
    native_size: str = flag("auto", "side in px the generator draws at before the bilinear enlargement to --image-size "
                            "that the loader gives the data (auto: 8 for digits, where it was measured, 0 for the "
                            "others; 0: none, the paper's generator)")
    augment: str = flag("none", "DiffAugment of every image the discriminator sees, comma-separated from "
                        f"{', '.join(POLICIES)} (none: no augmentation, the paper's)")
    eval_every: int = flag(0, "score the (average) generator every N steps, keeping checkpoints/best.ckpt at the "
                              "lowest FID (0: only at the end)")
    r1_gamma: float = flag(0.0, "weight of the R1 penalty gamma/2 E|grad_x D(x)|^2 on the real images the "
                                "discriminator sees (Mescheder et al. 2018; 0: none)")
    r1_every: int = flag(16, "take the R1 penalty every N discriminator steps, N times as strong (StyleGAN2's lazy "
                             "regularisation)")

    # what a run saved before a flag existed ran with (common/resume.py check_resume_config): such a run resumes
    # only with that value, so an older run does not continue through a generator it was not trained with
    saved_before = {"native_size": "0", "r1_gamma": 0.0, "r1_every": 16}

    def needs(self) -> set[str]:
        """What the run needs of a strategy (core's flags pass it to Fabric, which refuses a strategy that cannot
        give it): R1 takes a backward through the discriminator's input gradient."""
        return {"second_backward"} if self.r1_gamma else set()

    def generator_native_size(self) -> int:
        """--native-size as a side in px (0: none)."""
        return native_side(self.native_size, self.dataset)

    @staticmethod
    def resume_comparable(values: dict) -> dict:
        """The settings a resume compares, with --native-size auto as the side it stands for (auto and 8 on
        digits resume each other)."""
        return {**values, "native_size": str(native_side(values["native_size"], values["dataset"]))}

    def check(self):
        super().check()
        side = str(self.native_size)
        if side != "auto" and not (side.isdecimal() and side.isascii() and int(side) < self.image_size):
            raise ValueError(f"--native-size takes auto or a side in px from 0 to {self.image_size - 1} (below "
                             f"--image-size), got {side!r}")
        if self.accumulate > 1:
            raise ValueError("--accumulate: the GAN's BatchNorm layers normalise each micro-batch by its own "
                             "statistics, so N micro-batches would not train like one batch N times larger; "
                             "raise --batch-size instead")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"--ema-decay must be in [0, 1) (0 turns the average off), got {self.ema_decay}")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"--beta1 must be in [0, 1), got {self.beta1}")
        parse_policy(self.augment)
        self.check_at_least(1, "nz", "ngf", "ndf", "eval_samples")
        self.check_at_least(0, "eval_every", "sample_every", "lr")
        self.check_fits({"--ngf": self.ngf ** 2, "--ndf": self.ndf ** 2,  # a convolution's weight: width^2 at least
                         "--nz and --ngf": self.nz * self.ngf, "--eval-samples and --nz": self.eval_samples * self.nz,
                         "--batch-size and --image-size": self.batch_size * self.image_size ** 2})
        if self.r1_gamma < 0 or self.r1_every < 1:
            raise ValueError(f"--r1-gamma must be >= 0 and --r1-every >= 1, got {self.r1_gamma} and {self.r1_every}")
        if self.eval_every and self.dataset == "fake":
            raise ValueError("--eval-every: fake data has no classes to score against; pass --eval-every 0")


def native_side(value, dataset: str) -> int:
    """--native-size's value as a side in px: auto is the dataset's NATIVE_SIZE, or 0 where it has none."""
    return NATIVE_SIZE.get(dataset, 0) if str(value) == "auto" else int(value)
