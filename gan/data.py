"""The GAN's data: the image datasets of common/images.py (digits by default), by name."""
from common.images import CHANNELS, DATASETS, NATIVE_SIZE, DatasetNotFound, load_images, make_loader

__all__ = ["CHANNELS", "DATASETS", "NATIVE_SIZE", "DatasetNotFound", "load_images", "make_loader"]
