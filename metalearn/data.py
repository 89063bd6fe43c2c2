"""Task samplers: each call returns a meta-batch of tasks as (support_x, support_y, query_x, query_y).

- `sinusoid` (default, the MAML paper's regression): y = A sin(x - phase), A ~ U[0.1, 5],
  phase ~ U[0, pi], x ~ U[-5, 5].
- `digits`: N-way K-shot classification on scikit-learn's embedded 8x8 digits (classes 0-4 train,
  5-9 test, so test tasks are made of unseen classes).
- `omniglot`: N-way K-shot on Omniglot characters read by torchvision from --data-root
  (`omniglot-py/images_background` for training, `images_evaluation` for test), resized to 28 px.
Both classification sets count each class rotated by 90, 180 and 270 degrees as three more classes, as the
MAML paper does for Omniglot (after Santoro et al., 2016): digits would otherwise give 5 training classes,
which MAML memorises (training loss ~0, test accuracy near chance).
Every draw takes an explicit torch.Generator, so a meta-batch is a pure function of (seed, step).
"""
import math
from pathlib import Path

import torch

from common.data import download_failure, download_once
from common.images import load_digits

TASKS = ("sinusoid", "digits", "omniglot")


class Sinusoid:
    in_features, out_features = 1, 1

    def sample(self, tasks: int, shots: int, queries: int, generator: torch.Generator):
        amplitude = torch.empty(tasks, 1, 1).uniform_(0.1, 5.0, generator=generator)
        phase = torch.empty(tasks, 1, 1).uniform_(0, math.pi, generator=generator)
        x = torch.empty(tasks, shots + queries, 1).uniform_(-5.0, 5.0, generator=generator)
        y = amplitude * torch.sin(x - phase)
        return x[:, :shots], y[:, :shots], x[:, shots:], y[:, shots:]


class Classes:
    """N-way K-shot tasks over a tensor of images grouped by class: images (C, M, ...) for C classes
    of M examples each. Labels are 0..N-1 in a random order per task."""

    def __init__(self, images: torch.Tensor, ways: int):
        if ways > images.shape[0]:
            raise ValueError(f"{ways}-way tasks need {ways} classes, but only {images.shape[0]} are available")
        self.images, self.ways = images, ways
        self.in_features, self.out_features = images[0, 0].numel(), ways

    def sample(self, tasks: int, shots: int, queries: int, generator: torch.Generator):
        classes, per_class = self.images.shape[:2]
        if shots + queries > per_class:
            raise ValueError(f"{shots} shots + {queries} queries per class need {shots + queries} examples, "
                             f"but the classes have {per_class}: pass --shots and --queries that sum to at most "
                             f"{per_class} (omniglot: e.g. --shots 1 --queries 15)")
        chosen = torch.stack([torch.randperm(classes, generator=generator)[:self.ways] for _ in range(tasks)])
        picks = torch.stack([torch.stack([torch.randperm(per_class, generator=generator)[:shots + queries]
                                          for _ in range(self.ways)]) for _ in range(tasks)])  # (T, N, K+Q)
        x = self.images[chosen.unsqueeze(-1), picks].flatten(3)  # (T, N, K+Q, features)
        y = torch.arange(self.ways).view(1, -1, 1).expand(tasks, -1, shots + queries)
        support = x[:, :, :shots].flatten(1, 2), y[:, :, :shots].flatten(1, 2)
        query = x[:, :, shots:].flatten(1, 2), y[:, :, shots:].flatten(1, 2)
        return support[0], support[1], query[0], query[1]


def _digits_by_class(classes) -> torch.Tensor:
    images, labels = load_digits()
    images = images / 16.0
    per_class = min(int((labels == c).sum()) for c in classes)
    return torch.stack([images[labels == c][:per_class] for c in classes])  # (C, M, 8, 8)


def with_rotations(images: torch.Tensor) -> torch.Tensor:
    """(C, M, H, W) -> (4C, M, H, W): each class rotated by 0, 90, 180 and 270 degrees, as a class of its own."""
    return torch.cat([images.rot90(k, (2, 3)) for k in range(4)])


def _omniglot_by_class(root: str, background: bool, download: bool) -> torch.Tensor:
    from torchvision import datasets, transforms

    if not download and not Path(root).is_dir():
        raise FileNotFoundError(f"--data-root {root} does not exist; omniglot expects "
                                f"omniglot-py/images_background/<alphabet>/<character>/*.png there "
                                f"(with torchvision's zip files). Pass --download to fetch it.")
    try:
        with download_once(root, download):  # the ranks of a run take turns: one fetches
            dataset = datasets.Omniglot(root, background=background, download=download,
                                        transform=transforms.Compose([transforms.Resize(28), transforms.ToTensor()]))
    except (RuntimeError, OSError) as error:
        failure = download_failure("omniglot", root, "omniglot-py/images_background.zip and images_evaluation.zip",
                                   error) if download else None
        if failure is not None:
            raise failure from None
        raise FileNotFoundError(f"omniglot not found under {root}: expected omniglot-py/images_background and "
                                f"images_evaluation with their zip files ({error}). Pass --download to fetch "
                                f"it, or copy them there.") from None
    groups = {}
    for image, label in dataset:
        groups.setdefault(label, []).append(1.0 - image[0])  # strokes as 1 on a 0 background
    per_class = min(len(g) for g in groups.values())
    return torch.stack([torch.stack(g[:per_class]) for _, g in sorted(groups.items())])


def make_tasks(name: str, ways: int, train: bool, root: str = "data", download: bool = False):
    if name not in TASKS:
        raise ValueError(f"unknown task family {name!r}; choose one of: {', '.join(TASKS)}")
    if name == "sinusoid":
        return Sinusoid()
    if name == "digits":
        return Classes(with_rotations(_digits_by_class(range(5) if train else range(5, 10))), ways)
    return Classes(with_rotations(_omniglot_by_class(root, train, download)), ways)
