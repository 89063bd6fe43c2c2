"""What Fabric offers for Lightning Fabric's users beyond what a training step needs: callbacks and loggers
(`fabric.call`, `fabric.log`), a LightningModule's link to its Fabric, `rank_zero_first`, `init_module` and
`init_tensor`, `load_raw`, `fabric.accelerator` and `Fabric.seed_everything`. The workloads use none of them;
`Fabric` inherits them from `Conveniences`, which works on the Fabric's own strategy, precision and lists.
(`fabric run`'s environment variables are read in `core/launcher/environment.py`.)"""
import os
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from core import checkpoint, validation
from core.precision import map_nested
from core.seed import seed_everything
from core.wrappers import FabricModule, SkipInit


class Conveniences:
    """Mixed into Fabric: every method here uses `_strategy`, `_precision`, `_callbacks`, `_loggers` and
    `_module_of`, which Fabric sets."""

    def _after_setup(self, module: nn.Module, wrapped: FabricModule, optimizers: list | None) -> None:
        """As Lightning: a LightningModule learns its Fabric (its `self.fabric`, `self.log`, `self.logger` work)
        and becomes a callback; after `setup` (not setup_module), every callback's `on_after_setup(fabric=,
        module=)`."""
        if hasattr(module, "_fabric"):
            module._fabric = self
            if optimizers is not None:
                module._fabric_optimizers = optimizers
            if module not in self._callbacks:
                self._callbacks.append(module)
        if optimizers is not None:
            self.call("on_after_setup", fabric=self, module=wrapped)

    @contextmanager
    def rank_zero_first(self, local: bool = False):
        """Run the block on rank 0 (each node's local rank 0 with `local=True`) first, then on the other ranks,
        e.g. a download into a shared directory. The others wait up to CORE_RANK_ZERO_FIRST_TIMEOUT seconds
        (4 hours)."""
        first = (self.local_rank if local else self.global_rank) == 0
        timeout = float(os.environ.get("CORE_RANK_ZERO_FIRST_TIMEOUT", 4 * 3600))  # a download may take hours
        if not first:
            self._strategy.barrier(timeout)
        yield
        if first:
            self._strategy.barrier(timeout)

    # --- loggers and callbacks ---------------------------------------------------------------------
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

    def call(self, hook_name: str, *args, **kwargs) -> None:
        """Call `hook_name(*args, **kwargs)` on every callback that has it; keyword arguments a callback's
        method does not take are left out for that callback."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                raise TypeError(f"Callback {type(callback).__name__}.{hook_name} is not callable.")
            method(*args, **validation.accepted_kwargs(method, kwargs))

    @property
    def accelerator(self) -> "Accelerator":
        return Accelerator(self.device.type)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = False) -> int:
        """core.seed_everything, with each data-loader worker seeded too unless `workers=False` (Fabric's
        default, where the module-level function's is False)."""
        return seed_everything(seed, workers=True if workers is None else workers, verbose=verbose)

    def load_raw(self, path, obj, strict: bool = True, weights_only: bool | None = None) -> None:
        """Load a bare state dict saved with `torch.save(module.state_dict())` (or an optimizer's) into a
        module or optimizer, set up or not. `weights_only`: as for load."""
        with checkpoint.trusted(weights_only is False):
            raw = checkpoint.load_checkpoint(path, raw=True)
        checkpoint.restore({"obj": raw}, {"obj": obj}, self._strategy, self._precision, self._module_of, path, strict,
                           raw=True)

    @contextmanager
    def init_tensor(self):
        """Tensors created inside are created on this process's device and, under a true precision, in its
        dtype."""
        with self.device, self._precision.init_context():
            yield

    # --- building models --------------------------------------------------------------------------------
    @contextmanager
    def init_module(self, empty_init: bool | None = None):
        """Create modules inside this block directly on the device and, for the *-true precisions, in their
        dtype, instead of on the CPU in float32 first. `empty_init=True` skips the initialisation of weights
        that a checkpoint will overwrite; under fsdp it creates them on the meta device, so that no rank
        holds the whole model: setup shards it, allocates each rank's shard and runs reset_parameters."""
        self._check_launched()
        device = self._strategy.module_init_device(empty_init)
        with ExitStack() as stack:
            stack.enter_context(device)
            stack.enter_context(self._precision.init_context())
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


def _number(value):
    """A logged value as a number: a one-element tensor's item; a larger tensor is refused, as Lightning does."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"fabric.log takes numbers and one-element tensors, got a tensor of shape "
                         f"{tuple(value.shape)}: log a reduction of it (`.mean()`), or each element under its own "
                         f"name.")
    return value.item()
