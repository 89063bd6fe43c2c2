"""What `Fabric.setup_dataloaders` hands back: the loader sharded across processes (a DistributedSampler, or any
other sampler shared out by ShardedSampler), rebuilt as its own class when it is a DataLoader subclass, and
wrapped to call `set_epoch` at each pass and move each batch to the device."""
import inspect

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from core.errors import CoreTypeError, CoreValueError
from core.seed import WorkerSeeder, global_seed, seed_workers


class FabricDataLoader:
    """Iterates a DataLoader, calls `set_epoch` at each pass on every sampler of it that has one (its sampler,
    its batch sampler, and the sampler inside that: a DistributedSampler under a BatchSampler), and moves each
    batch to the device. A `set_epoch` you called yourself since the last pass is kept: the pass after it
    counts on from your epoch."""

    def __init__(self, loader: DataLoader, move_batch=None):
        self._loader = loader
        self._move_batch = move_batch
        self._epoch = 0  # the epoch of the next pass
        self._epoch_set = None  # what this wrapper last set

    def __len__(self):
        return len(self._loader)

    def __iter__(self):
        samplers = epoch_samplers(self._loader)
        if samplers:
            epoch = self._epoch
            for sampler in samplers:  # the user's own set_epoch since the last pass wins
                own = getattr(sampler, "epoch", self._epoch_set)
                if isinstance(own, int) and own != self._epoch_set:
                    epoch = own
            for sampler in samplers:
                sampler.set_epoch(epoch)
            self._epoch_set, self._epoch = epoch, epoch + 1
        if self._move_batch is None:
            yield from self._loader
        else:
            for batch in self._loader:
                yield self._move_batch(batch)

    def __getstate__(self):  # copy and pickle read the instance's own attributes, not __getattr__'s
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __getattr__(self, name):
        if name == "_loader":  # not set yet (an instance being unpickled): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self._loader, name)


def setup_loader(loader, world_size: int, rank: int, shard: bool, move_batch) -> FabricDataLoader:
    """What Fabric.setup_dataloaders returns for one loader: sharded across `world_size` processes (with `shard`),
    its workers seeded (after seed_everything(workers=True)), its batches moved by `move_batch` (None: as they are)."""
    if isinstance(loader, FabricDataLoader):
        raise CoreValueError("A dataloader should be passed only once to the `setup_dataloaders` method.")
    if not isinstance(loader, DataLoader):
        raise CoreTypeError(f"setup_dataloaders takes torch DataLoaders, got {type(loader).__name__}.")
    if shard and world_size > 1:
        loader = shard_loader(loader, world_size, rank, global_seed())
    if seed_workers() and loader.num_workers > 0 and not isinstance(loader.worker_init_fn, WorkerSeeder):
        loader = rebuild_loader(loader, worker_init_fn=WorkerSeeder(rank, loader.worker_init_fn))
    return FabricDataLoader(loader, move_batch)


def epoch_samplers(loader: DataLoader) -> list:
    """The samplers of `loader` that have a `set_epoch`, each once."""
    batch_sampler = loader.batch_sampler
    found = []
    for sampler in (loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)) and all(sampler is not other for other in found):
            found.append(sampler)
    return found


def shard_loader(loader: DataLoader, world_size: int, rank: int, seed: int) -> DataLoader:
    """The same loader with a sampler that gives this rank its share, as Lightning builds it: a Random or
    Sequential sampler becomes a DistributedSampler (shuffle kept, seeded with `seed`, padded to equal shares);
    any other sampler is drawn whole each pass and shared out (ShardedSampler). The loader's own drop_last
    still drops the last short batch."""
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas == world_size and sampler.rank == rank:
            return loader
        new_sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=sampler.shuffle,
                                         seed=sampler.seed, drop_last=loader.drop_last)
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):
        new_sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                         shuffle=isinstance(sampler, RandomSampler), seed=seed)
    else:
        new_sampler = ShardedSampler(sampler, world_size, rank)
    if loader.batch_size is None:
        raise CoreValueError("setup_dataloaders cannot shard a loader built with batch_sampler: build it with "
                             "batch_size, or pass use_distributed_sampler=False and shard it yourself.")
    return rebuild_loader(loader, sampler=new_sampler)


def rebuild_loader(loader: DataLoader, **changes) -> DataLoader:
    """A DataLoader like `loader` with `changes` (sampler, worker_init_fn) applied."""
    extra = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers > 0 else {}
    options = dict(batch_size=loader.batch_size, sampler=loader.sampler, num_workers=loader.num_workers,
                   collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                   timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
                   persistent_workers=loader.persistent_workers, **extra)
    if loader.batch_size is None:  # a batch_sampler carries the batching and the order
        options.update(batch_sampler=loader.batch_sampler, batch_size=1, sampler=None, drop_last=False)
    options.update(changes)
    if type(loader) is DataLoader:
        return DataLoader(loader.dataset, **options)
    return _rebuild_subclass(loader, {"dataset": loader.dataset, **options}, changes)


_LOADER_ARGUMENTS = set(inspect.signature(DataLoader.__init__).parameters)


def _rebuild_subclass(loader: DataLoader, options: dict, changes: dict) -> DataLoader:
    """A DataLoader subclass made again as Lightning makes it: its own constructor called with each of its
    arguments read back from the loader's attribute of the same name (or DataLoader's own argument), and the
    changed ones; an argument it cannot read back, or a change it cannot take, is an error that says so."""
    cls = type(loader)
    parameters = inspect.signature(cls.__init__).parameters
    named = {name: p for name, p in parameters.items()
             if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    kwargs, missing = {}, []
    for name, parameter in named.items():
        if name in options:
            kwargs[name] = options[name]
        elif name in _LOADER_ARGUMENTS:  # DataLoader's own (batch_sampler, shuffle, ...): options say them
            continue
        elif hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
        elif parameter.default is parameter.empty:
            missing.append(name)
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        kwargs.update({key: value for key, value in options.items() if key not in named})
    if "sampler" in changes and "shuffle" in named:
        kwargs["shuffle"] = False  # the new sampler decides the order
    refused = [key for key in changes if key not in kwargs]
    if missing or refused:
        problem = (f"its __init__ takes {', '.join(missing)}, which it does not keep as attributes of the same names"
                   if missing else f"its __init__ does not take {', '.join(refused)}")
        raise CoreValueError(f"setup_dataloaders must make {cls.__name__} again with {', '.join(changes)} changed, but "
                             f"{problem}. Keep each __init__ argument as an attribute (self.NAME = NAME) and pass "
                             f"**kwargs on to DataLoader, or pass use_distributed_sampler=False and give it a "
                             f"DistributedSampler yourself.")
    return cls(**kwargs)


class _Positions:
    """Stands in for a dataset of len(sampler) items, so DistributedSampler can share out positions."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self):
        return len(self.sampler)


class ShardedSampler(DistributedSampler):
    """Any sampler (SubsetRandomSampler, WeightedRandomSampler, your own) shared out across ranks: each pass
    draws the sampler's whole order once, and this rank takes every world_size-th entry of it, padded or
    dropped as DistributedSampler does. The ranks agree when the sampler draws the same order on each (seed
    it, e.g. with seed_everything before the loop)."""

    def __init__(self, sampler, num_replicas: int, rank: int, drop_last: bool = False):
        super().__init__(_Positions(sampler), num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=drop_last)
        self.sampler = sampler

    def __iter__(self):
        order = list(self.sampler)
        return (order[position] for position in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
