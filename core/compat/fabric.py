"""`core.compat.Fabric`: core's Fabric with what Lightning Fabric offers beyond a training step, for scripts ported
from Lightning: callbacks and loggers (`fabric.call`, `fabric.log`), a LightningModule's link to its Fabric,
`fabric run`'s environment, Lightning's other strategy names (ddp_spawn, ddp_fork, ddp_notebook,
ddp_find_unused_parameters_true, dp), `rank_zero_first`, `init_module` and `init_tensor`, `load_raw`,
`save(filter=)`, `fabric.accelerator` and `Fabric.seed_everything`. The workloads use none of it: they run on
`core.Fabric` (core/fabric.py), which this class extends and does not change.

    from core.compat import Fabric          # where the script had `from lightning.fabric import Fabric`
"""
import inspect
import os
import weakref
from collections import ChainMap
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from core import checkpoint, fabric, validation
from core.compat import environment
from core.compat.spawn import DDPSpawn, spawn
from core.nested import map_nested
from core.seed import seed_everything
from core.shared import resolve, share
from core.strategies import STRATEGIES, DDP
from core.wrappers import FabricModule


class StepThenCallbacks:
    """A set-up optimizer's step under the drop-in: core's step (an OptimizerStep), then each callback's
    `on_after_optimizer_step`. An object, as core's step is, so that a copy of the optimizer steps the copy; the
    Fabric (its callbacks, which may grow) is shared by a copy, not copied."""

    def __init__(self, step, fabric: "Fabric"):
        self.step, self.fabric = step, fabric

    def __call__(self, closure=None):
        output = self.step() if closure is None else self.step(closure)
        for callback in self.fabric._callbacks:
            hook = getattr(callback, "on_after_optimizer_step", None)
            if callable(hook):
                hook(strategy=self.fabric.strategy, optimizer=self.step.optimizer)
        return output

    def __getstate__(self):
        return share(self.__dict__, "fabric")

    def __setstate__(self, state):
        self.__dict__.update(resolve(state, "fabric"))


class _WeakSet:  # what a pickled Fabric holds in place of each weak set (a class: it unpickles as itself)
    pass


_NO_FUNCTION = object()  # launch() without a function (None is refused, as Lightning refuses it)
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")  # a LightningModule's

# Lightning's other names, for ported scripts (the training scripts' --strategy does not offer them)
LIGHTNING_STRATEGIES = {
    "ddp_spawn": (DDPSpawn, {}),
    "ddp_fork": (DDPSpawn, {"start_method": "fork"}),
    "ddp_notebook": (DDPSpawn, {"start_method": "fork"}),
    "ddp_find_unused_parameters_true": (DDP, {"find_unused_parameters": True}),
    "dp": ("core.compat.dp:DataParallel", {}),
}


class Fabric(fabric.Fabric):
    """core.Fabric, and Lightning Fabric's surface beyond a training step.

    Args (each of the first five, when not given, is read from the environment that Lightning's `fabric run`
    sets, LT_ACCELERATOR ... LT_PRECISION, else takes core.Fabric's default):
        accelerator, strategy, devices, num_nodes, precision: as for core.Fabric; strategy also takes
            LIGHTNING_STRATEGIES' names.
        plugins: refused (Lightning's plugins have no counterpart here), with what to use instead.
        callbacks: objects (or one) whose methods `fabric.call(name, ...)` calls.
        loggers: loggers (or one) that `fabric.log` and `fabric.log_dict` write to, e.g. core.compat.CSVLogger.
        **strategy_options: as for core.Fabric.
    """

    strategies = ChainMap(LIGHTNING_STRATEGIES, STRATEGIES)  # a view: register_strategy's names show here too

    def __init__(self, accelerator: str | None = None, strategy: str | None = None, devices=None,
                 num_nodes: int | None = None, precision=None, plugins=None, callbacks=None, loggers=None,
                 **strategy_options):
        if plugins is not None:
            raise ValueError("core takes no plugins: precision is chosen by name (precision='bf16-mixed'), the "
                             "cluster environment is read from torchrun or SLURM, and checkpoints are core's own.")
        super().__init__(accelerator=environment.from_cli("accelerator", accelerator, "auto"),
                         strategy=environment.from_cli("strategy", strategy, "auto"),
                         devices=environment.from_cli("devices", devices, "auto"),
                         num_nodes=environment.from_cli("num_nodes", num_nodes, 1),
                         precision=environment.from_cli("precision", precision, "32-true"), **strategy_options)
        self._callbacks = _as_list(callbacks)
        self._loggers = _as_list(loggers)
        if environment.started_by_cli():  # `fabric run` started every process: connect them now, as Lightning does
            fabric.Fabric.launch(self)  # core's launch: this class's refuses under `fabric run`

    def __getstate__(self):  # sent to ddp_spawn's processes: weak sets (of the set-up objects) do not pickle
        return {key: _WeakSet if isinstance(value, weakref.WeakSet) else value for key, value in self.__dict__.items()}

    def __setstate__(self, state):
        self.__dict__.update({key: weakref.WeakSet() if value is _WeakSet else value for key, value in state.items()})

    def launch(self, function=_NO_FUNCTION, *args, **kwargs):
        """As core.Fabric.launch; under ddp_spawn (and ddp_fork, ddp_notebook), `function` runs in new processes."""
        if function is not _NO_FUNCTION:
            validation.check_launch_function(function, args, kwargs)
        if environment.started_by_cli():
            raise RuntimeError("This script was started by `fabric run`, which started every process already; "
                               "remove the fabric.launch() call (or run the script with python instead).")
        if not isinstance(self.strategy, DDPSpawn) or self._launched:
            return super().launch(**kwargs) if function is _NO_FUNCTION else super().launch(function, *args, **kwargs)
        if function is _NO_FUNCTION:
            raise TypeError(f"strategy={self.strategy.name!r} runs a function in new processes: call "
                            f"fabric.launch(fn).")
        self._launched = True
        return spawn(function, self.world_size, self, args, kwargs)  # one node: its world is its devices

    # --- callbacks and a LightningModule's link ----------------------------------------------------
    def _after_setup(self, module: nn.Module, wrapped: FabricModule, optimizers: list | None) -> None:
        """As Lightning: a LightningModule's step methods run through the wrapper, as its forward does; it learns
        its Fabric (its `self.fabric`, `self.log`, `self.logger` work) and becomes a callback; after `setup` (not
        setup_module), every callback's `on_after_setup(fabric=, module=)`."""
        for name in STEP_METHODS:
            if callable(getattr(type(module), name, None)):
                wrapped.mark_forward_method(name)
        if hasattr(module, "_fabric"):
            module._fabric = self
            if optimizers is not None:
                module._fabric_optimizers = optimizers
            if module not in self._callbacks:
                self._callbacks.append(module)
        if optimizers is not None:
            self.call("on_after_setup", fabric=self, module=wrapped)

    def _step_function(self, optimizer, module: FabricModule):
        """core's step, then each callback's `on_after_optimizer_step(strategy=, optimizer=)` (Lightning's hook)."""
        return StepThenCallbacks(super()._step_function(optimizer, module), self)

    def call(self, hook_name: str, *args, **kwargs) -> None:
        """Call `hook_name(*args, **kwargs)` on every callback that has it; keyword arguments a callback's
        method does not take are left out for that callback."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                raise TypeError(f"Callback {type(callback).__name__}.{hook_name} is not callable.")
            method(*args, **_accepted_kwargs(method, kwargs))

    # --- loggers -----------------------------------------------------------------------------------
    @property
    def loggers(self) -> list:
        return self._loggers

    @property
    def logger(self):
        """The first logger (Lightning's convention), or None."""
        return self._loggers[0] if self._loggers else None

    def log(self, name: str, value, step: int | None = None) -> None:
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict, step: int | None = None) -> None:
        """Write metrics (tensors become numbers) to every logger; each logger writes on rank 0 only."""
        metrics = map_nested(metrics, _number)
        for logger in self._loggers:
            logger.log_metrics(metrics=metrics, step=step)

    # --- the rest of Lightning's surface -----------------------------------------------------------
    @contextmanager
    def rank_zero_first(self, local: bool = False):
        """Run the block on rank 0 (each node's local rank 0 with `local=True`) first, then on the other ranks,
        e.g. a download into a shared directory. The others wait up to CORE_RANK_ZERO_FIRST_TIMEOUT seconds
        (4 hours)."""
        first = (self.local_rank if local else self.global_rank) == 0
        timeout = float(os.environ.get("CORE_RANK_ZERO_FIRST_TIMEOUT", 4 * 3600))  # a download may take hours
        if not first:
            self.strategy.barrier(timeout)
        yield
        if first:
            self.strategy.barrier(timeout)

    @property
    def accelerator(self) -> "Accelerator":
        return Accelerator(self.device.type)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = False) -> int:
        """core.seed_everything, with each data-loader worker seeded too unless `workers=False` (Fabric's
        default, where the module-level function's is False)."""
        return seed_everything(seed, workers=True if workers is None else workers, verbose=verbose)

    def save(self, path, state: dict, filter: dict | None = None, background: bool = False):
        """As core.Fabric.save; `filter` ({key: fn(name, value) -> bool}) keeps only the entries of that key's
        state dict for which fn is True (Lightning's argument)."""
        edit = None if filter is None else (lambda collected: _apply_filter(collected, filter, self.strategy.name))
        return self._checkpoints.save(path, state, background, edit)

    def load_raw(self, path, obj, strict: bool = True, weights_only: bool | None = None) -> None:
        """Load a bare state dict saved with `torch.save(module.state_dict())` (or an optimizer's) into a
        module or optimizer, set up or not. `weights_only`: as for load."""
        with checkpoint.trusted(weights_only is False):
            raw = checkpoint.load_checkpoint(path, raw=True)
        self._checkpoints.restore({"obj": raw}, {"obj": obj}, path, strict, raw=True)

    @contextmanager
    def init_tensor(self):
        """Tensors created inside are created on this process's device and, under a true precision, in its
        dtype."""
        with self.device, self.strategy.precision.init_context():
            yield

    @contextmanager
    def init_module(self, empty_init: bool | None = None):
        """Create modules inside this block directly on the device and, for the *-true precisions, in their
        dtype, instead of on the CPU in float32 first. `empty_init=True` skips the initialisation of weights
        that a checkpoint will overwrite; under fsdp it creates them on the meta device, so that no rank
        holds the whole model: setup shards it, allocates each rank's shard and runs reset_parameters."""
        self._check_launched()
        device = self.strategy.module_init_device(empty_init)
        with ExitStack() as stack:
            stack.enter_context(device)
            stack.enter_context(self.strategy.precision.init_context())
            if empty_init and device.type != "meta":
                stack.enter_context(SkipInit())
            yield


class Accelerator:
    """`fabric.accelerator`: the kind of device a run uses ("cpu" or "cuda"), and how many of it this
    machine has; what Lightning's Accelerator objects are mostly asked."""

    def __init__(self, name: str):
        self.name = name

    def auto_device_count(self) -> int:
        return torch.cuda.device_count() if self.name == "cuda" else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self.name == "cuda" else True

    def __repr__(self) -> str:
        return f"Accelerator({self.name!r})"


class SkipInit(torch.overrides.TorchFunctionMode):
    """Within: torch.nn.init functions leave tensors as they are (uninitialised), for weights that a
    checkpoint will overwrite (init_module(empty_init=True))."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **(kwargs or {}))


def _apply_filter(collected: dict, filter: dict, strategy: str) -> dict:
    """save's `filter`, as Lightning applies it: to the entries of each filtered key's state dict (an optimizer's:
    to its state dict's own entries)."""
    if not isinstance(filter, dict):
        raise TypeError(f"filter must be a dict of {{state key: callable}}, got {filter!r}.")
    unknown = set(filter) - set(collected)
    if unknown:
        raise ValueError(f"The filter keys {sorted(unknown)} are not keys of the state ({sorted(collected)}).")
    out = dict(collected)
    for key, keep in filter.items():
        if not callable(keep):
            raise TypeError(f"filter[{key!r}] must be a callable (name, value) -> bool, got {keep!r}.")
        value = collected[key]
        entries = value["optimizer"] if checkpoint.is_optimizer_entry(value) else value
        if isinstance(entries, checkpoint.InEngine):  # a DeepSpeed engine writes it whole, in save_checkpoint
            raise TypeError(f"strategy={strategy!r} saves {key!r} through DeepSpeed's engine, which takes no "
                            f"filter; save without it.")
        if not isinstance(entries, dict):
            continue
        kept = {k: v for k, v in entries.items() if keep(k, v)}
        out[key] = {**value, "optimizer": kept} if entries is not value else kept
    return out


def _number(value):
    """A logged value as a number: a one-element tensor's item; a larger tensor is refused, as Lightning does."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"fabric.log takes numbers and one-element tensors, got a tensor of shape "
                         f"{tuple(value.shape)}: log a reduction of it (`.mean()`), or each element under its own "
                         f"name.")
    return value.item()


def _as_list(items) -> list:
    return [] if items is None else list(items) if isinstance(items, (list, tuple)) else [items]


def _accepted_kwargs(method, kwargs: dict) -> dict:
    """The part of `kwargs` that `method` takes (all of it when it takes **kwargs)."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (ValueError, TypeError):  # a builtin or C method: its signature cannot be read, so it gets all of them
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters}
    return {key: value for key, value in kwargs.items() if key in names}
