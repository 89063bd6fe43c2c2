"""Image datasets by name, scaled to [-1, 1] at a square size: the data of the GAN and the autoencoder.

`digits` (the default) is scikit-learn's 1,797 real 8x8 handwritten digits, shipped inside its wheel,
so the suite trains with no download. `mnist`, `fashion-mnist`, `cifar10`, `celeba` and `folder` (any
ImageFolder tree) load through torchvision from `--data-root`; `fake` is noise for smoke tests only.
"""
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.data import download_failure, download_once

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "celeba", "folder", "fake")
CHANNELS = {"digits": 1, "mnist": 1, "fashion-mnist": 1, "cifar10": 3, "celeba": 3, "folder": 3, "fake": 1}
# The side the embedded digits are stored at (8x8 scans) before _digits enlarges them bilinearly (align_corners
# False): the GAN's --native-size auto. Only where it was measured; for MNIST (28 px) or CIFAR-10 (32 px), which
# torchvision resizes from 8-bit images, --native-size N sets it by hand.
NATIVE_SIZE = {"digits": 8}

# Where torchvision looks for each dataset under --data-root, and what it expects to find there.
_EXPECTED = {
    "mnist": "MNIST/raw/train-images-idx3-ubyte (+ train-labels, t10k-*), unpacked from their .gz",
    "fashion-mnist": "FashionMNIST/raw/train-images-idx3-ubyte (+ train-labels, t10k-*), unpacked from their .gz",
    "cifar10": "cifar-10-batches-py/data_batch_1..5, test_batch, batches.meta (the python version)",
    "celeba": "celeba/img_align_celeba/*.jpg and celeba/list_eval_partition.txt, identity_CelebA.txt, ...",
    "folder": "<class>/<image> files (torchvision ImageFolder layout), one sub-folder per class",
}


class DatasetNotFound(FileNotFoundError):
    """The dataset's files are not under the data root; the message says where they must be."""


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 digits as (1797, 8, 8) float32 in [0, 16] and their int64 labels: the arrays of
    `sklearn.datasets.load_digits` (tests/test_data.py checks), read from the file scikit-learn's wheel ships
    without importing scikit-learn, which costs every process of a run 1-3 s (most of it scipy.stats)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ModuleNotFoundError("The embedded digits ship inside scikit-learn: pip install scikit-learn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # scikit-learn moved its file: its own loader reads it
        from sklearn.datasets import load_digits as sklearn_digits
        digits = sklearn_digits()
        return torch.tensor(digits.images, dtype=torch.float32), torch.tensor(digits.target)
    data = np.loadtxt(path, delimiter=",", dtype=np.float32)  # 64 pixels, then the label, per row
    return torch.from_numpy(data[:, :-1]).view(-1, 8, 8), torch.from_numpy(data[:, -1]).long()


def _digits(image_size: int, train: bool):
    images, labels = load_digits()
    images = images.unsqueeze(1) / 16.0  # (1797, 1, 8, 8) in [0, 1]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    split = int(0.8 * len(order))  # a fixed 80/20 split: 1,437 train, 360 held out
    index = order[:split] if train else order[split:]
    images = F.interpolate(images[index], size=image_size, mode="bilinear", align_corners=False)
    return TensorDataset(images.clamp(0, 1) * 2 - 1, labels[index])


def _to_rgb(image):  # a module-level function, so worker processes can pickle the transform
    return image.convert("RGB")


def _torchvision(name: str, root: Path, image_size: int, train: bool, download: bool):
    from torchvision import datasets, transforms

    steps = [transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
             transforms.Normalize([0.5] * CHANNELS[name], [0.5] * CHANNELS[name])]
    if name == "folder":
        steps.insert(0, _to_rgb)
    transform = transforms.Compose(steps)
    try:
        with download_once(root, download):  # the ranks of a run take turns: one fetches
            if name == "mnist":
                return datasets.MNIST(root, train=train, download=download, transform=transform)
            if name == "fashion-mnist":
                return datasets.FashionMNIST(root, train=train, download=download, transform=transform)
            if name == "cifar10":
                return datasets.CIFAR10(root, train=train, download=download, transform=transform)
            if name == "celeba":
                return datasets.CelebA(root, split="train" if train else "test", target_type="identity",
                                       download=download, transform=transform)
            return datasets.ImageFolder(root, transform=transform)
    except (RuntimeError, OSError) as error:
        failure = download_failure(name, root, _EXPECTED[name], error) if download else None
        if failure is not None:
            raise failure from None
        hint = "" if name == "folder" or download else \
            " Pass --download to fetch it (needs internet), or copy the files there."
        raise DatasetNotFound(f"dataset {name!r} not found under {root}: expected {_EXPECTED[name]} "
                              f"({error}).{hint}") from None


def load_images(name: str, root: str = "data", image_size: int = 32, train: bool = True,
                download: bool = False, fake_size: int = 256):
    """A dataset of (image in [-1, 1] of shape (C, image_size, image_size), label) pairs."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if name == "digits":
        return _digits(image_size, train)
    if name == "fake":
        g = torch.Generator().manual_seed(0 if train else 1)
        return TensorDataset(torch.rand(fake_size, 1, image_size, image_size, generator=g) * 2 - 1,
                             torch.randint(0, 10, (fake_size,), generator=g))
    root = Path(root)
    if not download and not root.is_dir():
        raise DatasetNotFound(f"--data-root {root} does not exist; dataset {name!r} expects {_EXPECTED[name]} "
                              f"there. Create it, or pass --download to fetch the dataset.")
    dataset = _torchvision(name, root, image_size, train, download)
    if len(dataset) == 0:
        raise DatasetNotFound(f"dataset {name!r} under {root} is empty; expected {_EXPECTED[name]}")
    return dataset


def make_loader(dataset, batch_size: int, seed: int, num_workers: int = 0, rank: int = 0, world_size: int = 1,
                pin_memory: bool = False):
    """Shuffled batches in an order fixed by (seed, epoch); each of `world_size` ranks takes its share.
    `pin_memory`: batches in page-locked memory, for asynchronous copies to a GPU."""
    if batch_size * world_size > len(dataset):
        raise ValueError(f"--batch-size {batch_size} x {world_size} process(es) is more than the "
                         f"{len(dataset)} examples of the dataset")
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=pin_memory)
