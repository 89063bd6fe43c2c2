"""The autoencoder's data: the image datasets of common/images.py (digits by default) and their held-out split."""
from common.images import CHANNELS, DATASETS, DatasetNotFound, load_images, make_loader

__all__ = ["CHANNELS", "DATASETS", "DatasetNotFound", "load_images", "make_loader", "load_splits"]


def load_splits(name: str, root: str, image_size: int, download: bool = False):
    """(train, test) datasets of (image in [-1, 1], label) pairs."""
    return (load_images(name, root, image_size, train=True, download=download),
            load_images(name, root, image_size, train=False, download=download))
