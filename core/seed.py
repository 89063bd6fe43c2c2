"""Seeding every random number generator a training script touches, in its processes and data workers."""
import os
import random

import numpy
import torch

from core.errors import CoreTypeError, CoreValueError

SEED_VARIABLE, WORKERS_VARIABLE = "PL_GLOBAL_SEED", "PL_SEED_WORKERS"  # Lightning's names, so either seeds the other


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = False) -> int:
    """Seed Python's `random`, NumPy and torch (all devices); return the seed. `seed=None` takes the seed a
    launcher or an earlier call left in the environment (PL_GLOBAL_SEED), else 0. The seed is also what
    `setup_dataloaders` gives the DistributedSampler it injects; with `workers=True` each data-loader worker
    of a set-up loader seeds `random`, NumPy and torch from (torch's seed for that worker, its rank).
    `verbose=True` prints the seed (Lightning's default; core's is quiet)."""
    if seed is None:
        value = os.environ.get(SEED_VARIABLE, "0")
        try:
            seed = int(value)  # as int reads it: " 5" and "+5" too
        except ValueError:
            raise CoreValueError(f"{SEED_VARIABLE}={value!r} in the environment is not a whole number: set it to one "
                                 f"(or unset it), or pass the seed to seed_everything.") from None
    if isinstance(seed, bool) or isinstance(seed, float) and not seed.is_integer():
        raise CoreTypeError(f"seed must be a whole number, got {seed!r}.")
    try:
        seed = int(seed)  # as Lightning: 42.0, a NumPy integer, "42", a one-element tensor
    except TypeError:
        raise CoreTypeError(f"seed must be a whole number, got {seed!r}.") from None
    except ValueError:  # a string that is not a number: a ValueError, as int's (and Lightning's)
        raise CoreValueError(f"seed must be a whole number, got {seed!r}.") from None
    if not 0 <= seed < 2**32:
        raise CoreValueError(f"seed must be in [0, 2**32), got {seed}.")
    # (the launcher's ranks and the loaders' workers read these two, as Lightning's do; nothing else is set)
    os.environ[SEED_VARIABLE] = str(seed)
    os.environ[WORKERS_VARIABLE] = str(int(workers))
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    if verbose:
        print(f"Seed set to {seed}")
    return seed


def global_seed() -> int:
    """The seed given to seed_everything (in this process or the launcher's), else 0."""
    return int(os.environ.get(SEED_VARIABLE, 0))


def seed_workers() -> bool:
    return os.environ.get(WORKERS_VARIABLE) == "1"


class WorkerSeeder:
    """A DataLoader `worker_init_fn` that mixes the rank into each worker's seeds. torch seeds `random`, NumPy
    and torch in each worker from the loader's base seed and the worker's id, but the ranks of a DDP run draw
    the same base seed from the same seeded generator, so without the rank their workers would apply the
    same random augmentations to their different shares of the data."""

    def __init__(self, rank: int, user_init=None):
        self.rank, self.user_init = rank, user_init

    def __call__(self, worker_id: int) -> None:
        sequence = numpy.random.SeedSequence([torch.initial_seed() % 2**64, self.rank])  # torch's seed: per worker
        torch_seed, random_seed, numpy_seed = sequence.generate_state(3, dtype=numpy.uint64)
        torch.manual_seed(int(torch_seed))
        random.seed(int(random_seed))
        numpy.random.seed(int(numpy_seed) % 2**32)
        if self.user_init is not None:
            self.user_init(worker_id)
