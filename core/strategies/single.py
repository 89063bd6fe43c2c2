"""The base strategy: one process, one device. Every other strategy extends it and overrides what it changes
(how a module is wrapped, how gradients are synchronised, the collectives, how state is saved)."""
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from core import checkpoint
from core.errors import CoreTypeError, CoreValueError


class SingleDevice:
    """One process, one device. Every other strategy extends this one."""

    name = "single"  # its registry name, set by make_strategy before __init__
    distributed = False
    joint_setup = False  # DeepSpeed needs model and optimizers together
    guard_submodules = False  # a wrapper that syncs gradients, which a child called directly would skip
    moves_module = True  # False where the engine places the module itself
    changes_module = False  # True where setup changes the module in place (sharding, an engine): set up once only
    backward_needs_module = False  # True where backward goes through the module's engine
    options_key = None  # the name of this strategy's per-module options in setup(..., ddp={...})
    needs = frozenset()  # what the script needs (Fabric(needs=...), core.strategies.NEEDS), set by make_strategy

    @classmethod
    def refusal(cls, needs: set, precision: str, options: dict) -> str | None:
        """Why this strategy, made with `options` under `precision` (a name), cannot give a script what it
        `needs` (names in core.strategies.NEEDS); None where it can. Asked before any process starts."""
        return None

    def __init__(self, device: torch.device, precision, **options):
        if options and not self.distributed:
            raise CoreTypeError(f"Fabric() got unknown argument(s) {sorted(options)}. It takes accelerator, strategy, "
                                f"devices, num_nodes, precision, plugins, callbacks and loggers; other keywords are "
                                f"options of a distributed strategy (ddp: DistributedDataParallel's arguments; fsdp: "
                                f"wrap_modules, reshard_after_forward, cpu_offload; deepspeed: config), and this run's "
                                f"strategy, single, takes none.")
        self.device = device
        self.precision = self.choose_precision(precision)
        self.options = options  # defaults for every module; setup(..., ddp={...}) overrides per module
        self.global_rank = self.local_rank = self.node_rank = 0
        self.world_size = 1

    def choose_precision(self, precision):
        """The variant of `precision` this strategy runs (the mode itself, here), or a ValueError saying
        why it cannot run it."""
        return precision

    def setup_environment(self, env: dict | None) -> None:
        pass

    def module_init_device(self, empty_init: bool | None) -> torch.device:
        """Where Fabric.init_module creates modules: this process's device, or the CPU where an engine places
        the module itself."""
        return self.device if self.moves_module else torch.device("cpu")

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, **kwargs):
        forward_module = self.setup_module(module, **kwargs)
        return forward_module, optimizers

    def setup_module(self, module: nn.Module, **kwargs) -> nn.Module:
        if kwargs:
            raise CoreValueError(f"{type(self).__name__} takes no per-module options, got {sorted(kwargs)}.")
        return module

    def check_optimizer(self, optimizer, module: nn.Module | None) -> None:
        pass

    def backward(self, loss: torch.Tensor, module, *args, **kwargs) -> None:
        loss.backward(*args, **kwargs)

    def optimizer_step(self, optimizer, module, **kwargs):
        return self.precision.optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module) -> "contextmanager":
        return nullcontext()

    def keep_for_second_backward(self, module, optimizers: list) -> None:
        """Before a gradient with respect to a module's inputs is taken with create_graph (fabric.grad), keep
        what the backward that follows (through that gradient) needs until `optimizers` step. Nothing here."""

    def clip_gradients(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_by_value(self, module, optimizer, clip_val) -> None:
        """Clip the gradients this optimizer steps (as by norm): the module's others may still be scaled by
        16-mixed's loss scale, and under fsdp a module kept gathered lists its unsharded parameters, whose
        gradients are on the shards."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if params:  # torch fails on a list without gradients
            torch.nn.utils.clip_grad_value_(params, clip_val)

    # collectives: identities on one process
    def barrier(self, timeout: float | None = None, group=None) -> None:
        pass

    def all_reduce(self, tensor, op, group=None):
        return tensor

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return tensor

    def parameter_shares(self):
        """None where each process holds every parameter whole (or as a self-sharding DTensor); else an object
        that says what it holds (`common/ema.py` WholeParameters' methods), set on each set-up module as
        `parameter_shares` for code that works on a process's own share (the EMA, the weight check)."""
        return None

    def broadcast(self, obj, src: int = 0):
        return obj

    # checkpoints: the logical checkpoint (full state dicts keyed by name) in one file, written by rank 0
    def save_checkpoint(self, path, state: dict, group=None) -> None:
        """Write `state` (collected by core/state.py) to `path`; `group`: the process group a background save's
        collectives use (background_group), None for the default one."""
        problem = None
        if self.global_rank == 0:
            try:
                checkpoint.save_file(state, path)
            except checkpoint.NoSpace as error:
                problem = str(error)
        self.stop_together(problem, group)

    def background_group(self):
        """The process group of background saves, which run beside training's collectives (one process: none)."""
        return None

    def stop_together(self, problem: str | None, group=None) -> None:
        """After a save: every rank raises the NoSpace error of `problem` if any rank had one (one line, said by
        rank 0), and meets the others either way."""
        if problem is not None:
            error = checkpoint.NoSpace(problem)
            error.every_rank = True
            raise error

    def verify_checkpoint(self, path) -> str | None:
        """Refuse a checkpoint whose files do not match the checksums saved with them (core/checkpoint/integrity.py);
        return a note for one saved without checksums (said once it has loaded)."""
        found, note = checkpoint.integrity.problems(path)
        return self._verdict(path, found, note)

    def _verdict(self, path, found: list[str], note: str | None) -> str | None:
        if found:
            error = checkpoint.CheckpointError(checkpoint.integrity.refusal(path, found))
            error.every_rank = True  # the ranks agreed on it: a script's one line comes from rank 0
            raise error
        return note

    def load_checkpoint(self, path, held=None) -> dict:
        """What `path` holds, for `restore` to load: here any format, read whole. `held()` gives what this
        process holds now in the layout `fabric.save` writes, for strategies that read into it in place."""
        return checkpoint.read(path)

    def parameter_names(self, optimizer, wrapped_module) -> list[list[str]]:
        return checkpoint.parameter_names(optimizer, wrapped_module.module)

    def module_state(self, wrapped) -> dict:
        return wrapped.module.state_dict()

    def load_module_state(self, wrapped, state: dict, strict: bool, key: str, path) -> None:
        checkpoint.check_state_dict(wrapped.module, state, key, strict)
        self._load_state_dict(wrapped, state, strict)

    def _load_state_dict(self, wrapped, state: dict, strict: bool) -> None:
        wrapped.module.load_state_dict(state, strict=strict)

    def optimizer_state(self, optimizer, wrapped_module) -> dict:
        return checkpoint.named_optimizer_state(optimizer.state_dict(), self.parameter_names(optimizer, wrapped_module))

    def load_optimizer_state(self, optimizer, wrapped_module, state: dict) -> None:
        frozen = {name for name, p in wrapped_module.module.named_parameters() if not p.requires_grad}
        optimizer.load_state_dict(checkpoint.indexed_optimizer_state(state, self.parameter_names(optimizer,
                                                                                                 wrapped_module),
                                                                     frozen))

    def teardown(self) -> None:
        pass
