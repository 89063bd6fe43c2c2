"""Seeding every random number generator a training script touches."""
import os
import random

import torch


def seed_everything(seed: int) -> int:
    """Seed Python's `random`, NumPy and torch (all devices); return the seed."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    return seed
