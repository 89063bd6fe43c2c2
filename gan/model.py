"""DCGAN generator and discriminator (Radford et al., 2016), for 32 or 64 px images; the generator can end at
the data's native size (`native_size`: the digits' 8x8).

Paper notation: `nz` latent size, `ngf`/`ndf` feature maps of the first generator / discriminator layer.
The discriminator returns logits (train it with BCE-with-logits, which is safe under autocast).
"""
import torch.nn.functional as F
from torch import nn


def _check_size(image_size: int) -> int:
    if image_size not in (32, 64):
        raise ValueError(f"image size must be 32 or 64, got {image_size}")
    return image_size // 32  # 1 or 2: how many 2x stages beyond the 32 px stack


class Generator(nn.Module):
    """`native_size` N > 0: the output is averaged down to N x N and enlarged back bilinearly, the way the loader
    enlarges a dataset stored at N px (common/images.py, the 8x8 digits), so G draws only images of the kind the
    data holds (at 32 px, the digits are 8x8 images and nothing finer). 0: the paper's generator. No parameters."""

    def __init__(self, nz: int = 64, ngf: int = 32, channels: int = 1, image_size: int = 32, native_size: int = 0):
        super().__init__()
        if not 0 <= native_size < image_size:
            raise ValueError(f"native size must be in [0, {image_size}) (0: none), got {native_size}")
        extra = _check_size(image_size) - 1  # 0 for 32 px, 1 for 64 px
        width = ngf * 2 ** (2 + extra)
        layers = [nn.ConvTranspose2d(nz, width, 4, 1, 0, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)]
        # state size: width x 4 x 4, then each stage halves the width and doubles the side
        for _ in range(2 + extra):
            layers += [nn.ConvTranspose2d(width, width // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(width // 2),
                       nn.ReLU(True)]
            width //= 2
        # state size: ngf x (image_size / 2) x (image_size / 2)
        layers += [nn.ConvTranspose2d(width, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)
        self.nz, self.image_size, self.native_size = nz, image_size, native_size
        self.apply(init_weights)

    def forward(self, z):  # (B, nz, 1, 1) -> (B, channels, image_size, image_size) in [-1, 1]
        images = self.main(z)
        if self.native_size:  # averages and bilinear weights are convex: the images stay in [-1, 1]
            images = F.interpolate(F.adaptive_avg_pool2d(images, self.native_size), size=self.image_size,
                                   mode="bilinear", align_corners=False)
        return images


class Discriminator(nn.Module):
    def __init__(self, ndf: int = 32, channels: int = 1, image_size: int = 32):
        super().__init__()
        extra = _check_size(image_size) - 1
        layers = [nn.Conv2d(channels, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        width = ndf
        # state size: ndf x (image_size / 2) x (image_size / 2)
        for _ in range(2 + extra):
            layers += [nn.Conv2d(width, width * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(width * 2),
                       nn.LeakyReLU(0.2, inplace=True)]
            width *= 2
        # state size: width x 4 x 4
        layers += [nn.Conv2d(width, 1, 4, 1, 0, bias=False)]
        self.main = nn.Sequential(*layers)
        self.apply(init_weights)

    def forward(self, images):  # (B, channels, H, W) -> (B,) logits
        # a tensor of its own, not a view of the last conv's (B, 1, 1, 1) output: an in-place op on a view
        # of a module's output would skip FSDP2's pre-backward hook, so FSDP2 warns about every such output
        return self.main(images).flatten().clone()


def init_weights(module: nn.Module) -> None:
    """The paper's initialisation: conv weights ~ N(0, 0.02), BatchNorm scale ~ N(1, 0.02), shift 0."""
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)
