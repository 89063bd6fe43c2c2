"""Differentiable augmentation of everything the discriminator sees (DiffAugment: Zhao et al., 2020,
"Differentiable Augmentation for Data-Efficient GAN Training").

With 1,437 training digits, D learns the training set by heart: over most of a default run without it, D
gives real images 0.7-0.95 and generated ones 0.02-0.3. DiffAugment passes real and generated images alike through
the same kind of random transforms before D, in both D's and G's steps; the transforms are differentiable,
so G's gradient reaches G through them, and G is not taught to produce shifted or cut images because D
sees its images only after the same transforms as the real ones. Each image gets its own draws. Off by
default (`--augment none`): in the default 3000 steps it raised the FID (gan/README.md).

    augment = Augment("translation,cutout")
    logits = discriminator(augment(images, draws))          # draws: a torch.Generator (CPU)

Policies, applied in this order (the paper's, for images in [-1, 1]):
- color: brightness + U(-0.5, 0.5), saturation x U(0, 2) (images of 3 channels), contrast x U(0.5, 1.5);
- translation: a shift of up to 1/8 of the side in each direction, in whole pixels, the uncovered border 0;
- cutout: a square of half the side, centred anywhere in the image, set to 0 (clipped at the edges).
"""
import torch
import torch.nn.functional as F

def parse_policy(text: str) -> tuple[str, ...]:
    """'translation,cutout' -> ("translation", "cutout") in the order they are applied; 'none' -> ()."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["none"]:
        return ()
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise ValueError(f"--augment takes 'none' or a comma-separated list of {', '.join(POLICIES)}; got {text!r}")
    return tuple(name for name in POLICIES if name in names)


def _uniform(images, draws, low, high):  # one value per image, shaped to broadcast over (C, H, W)
    values = torch.rand(images.size(0), 1, 1, 1, generator=draws) * (high - low) + low
    return values.to(images.device, images.dtype)


def color(images, draws):
    images = images + _uniform(images, draws, -0.5, 0.5)
    if images.size(1) == 3:
        mean = images.mean(dim=1, keepdim=True)
        images = (images - mean) * _uniform(images, draws, 0, 2) + mean
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    return (images - mean) * _uniform(images, draws, 0.5, 1.5) + mean


def translation(images, draws):
    batch, _, height, width = images.shape
    pad_y, pad_x = height // 8, width // 8
    shift_y = torch.randint(-pad_y, pad_y + 1, (batch, 1), generator=draws).to(images.device)
    shift_x = torch.randint(-pad_x, pad_x + 1, (batch, 1), generator=draws).to(images.device)
    padded = F.pad(images, (pad_x, pad_x, pad_y, pad_y))
    rows = torch.arange(height, device=images.device) + pad_y - shift_y  # (B, H): source row of each row
    columns = torch.arange(width, device=images.device) + pad_x - shift_x
    index = torch.arange(batch, device=images.device)[:, None, None]
    return padded[index, :, rows[:, :, None], columns[:, None, :]].permute(0, 3, 1, 2)  # (B, H, W, C) -> NCHW


def cutout(images, draws):
    batch, _, height, width = images.shape
    size_y, size_x = height // 2, width // 2
    top = torch.randint(0, height, (batch, 1), generator=draws).to(images.device) - size_y // 2
    left = torch.randint(0, width, (batch, 1), generator=draws).to(images.device) - size_x // 2
    rows, columns = torch.arange(height, device=images.device), torch.arange(width, device=images.device)
    inside_rows = (rows >= top) & (rows < top + size_y)  # (B, H)
    inside_columns = (columns >= left) & (columns < left + size_x)
    keep = ~(inside_rows[:, :, None] & inside_columns[:, None, :])
    return images * keep[:, None].to(images.dtype)


TRANSFORMS = {"color": color, "translation": translation, "cutout": cutout}  # in the order they are applied
POLICIES = tuple(TRANSFORMS)


class Augment:
    def __init__(self, policy: str):
        self.policy = parse_policy(policy)

    def __call__(self, images: torch.Tensor, draws: torch.Generator) -> torch.Tensor:
        """`images` through each transform of the policy, each image with its own draws from `draws`; with no
        policy, `images` itself and nothing drawn."""
        for name in self.policy:
            images = TRANSFORMS[name](images, draws)
        return images
