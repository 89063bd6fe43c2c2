"""FSDP strategy on FSDP2 (`torch.distributed.fsdp.fully_shard`): gloo on CPU, NCCL on CUDA.

Each set-up module is sharded in place: submodules of the types named in `wrap_modules` become
their own shard groups (all-gathered one at a time), then the module itself. Several sharded
modules in one process are independent (a GAN's generator and discriminator).

Checkpoints are sharded (`core/checkpoint/sharded.py`): every rank writes its own shards of the model and optimizer
state, keyed by parameter name, and reads back only what it holds, resharded by DCP to any number of
processes; nothing is gathered on rank 0. A one-file or DeepSpeed checkpoint loads whole on each rank and
is sharded here.
"""
import warnings
from contextlib import contextmanager

import torch
from torch import nn

from core.errors import CoreRuntimeError, CoreValueError
from core.strategies.ddp import DDP
from core.strategies.shares import ShardedParameters


class FSDP(DDP):
    guard_submodules = False  # FSDP2 hooks live on the module itself, so there is no wrapper to skip
    options_key = "fsdp"
    changes_module = True

    def __init__(self, device, precision, wrap_modules=(), reshard_after_forward: bool | None = None,
                 cpu_offload: bool = False, timeout=None):
        """`reshard_after_forward` None is FSDP2's own default: the shard groups inside free their gathered
        parameters after forward and gather them again in backward, the root keeps them (it is needed first in
        backward). True made the root all-gather twice per step (122 all-gathers in 60 steps against plain
        FSDP2's 61, benchmarks/plain_fsdp.py). `timeout`: as for ddp."""
        super().__init__(device, precision, timeout=timeout)
        self.wrap_modules = tuple(wrap_modules)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self._mesh = None
        self._gathered = {}  # id(set-up module) -> its shard groups, kept gathered for a second backward

    def choose_precision(self, precision):
        precision.fsdp_policy()  # refuses a mode FSDP cannot run (16-mixed: no sharded loss scaler)
        return precision

    def setup_module(self, module: nn.Module, **kwargs) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        options = {"mesh": self._mesh, "reshard_after_forward": kwargs.pop("reshard_after_forward",
                                                                           self.reshard_after_forward)}
        policy = self.precision.fsdp_policy()
        if policy is not None:
            options["mp_policy"] = policy
        if kwargs.pop("cpu_offload", self.cpu_offload):
            options["offload_policy"] = CPUOffloadPolicy()
        wrap_modules = tuple(kwargs.pop("wrap_modules", self.wrap_modules))
        if kwargs:
            raise CoreValueError(f"Unknown fsdp options {sorted(kwargs)}; it takes wrap_modules, "
                                 f"reshard_after_forward and cpu_offload.")
        on_meta = any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))
        for sub in list(module.modules())[1:]:
            if "mp_policy" in options and isinstance(sub, nn.modules.batchnorm._BatchNorm):
                # BatchNorm keeps float32 running statistics; with bfloat16 weights it fails on CPU, so its
                # parameters stay float32 in a shard group of their own (autocast handles its input)
                fully_shard(sub, **{**options, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32)})
            elif wrap_modules and isinstance(sub, wrap_modules):
                fully_shard(sub, **options)
        fully_shard(module, **options)
        if on_meta:  # made under init_module(empty_init=True): each rank allocates its shard only, then initialises it
            module.to_empty(device=self.device)
            left = set()
            with torch.no_grad():
                for sub in module.modules():
                    if callable(getattr(sub, "reset_parameters", None)):
                        sub.reset_parameters()
                    elif next(sub.parameters(recurse=False), None) is not None or \
                            next(sub.buffers(recurse=False), None) is not None:
                        left.add(type(sub).__name__)
            if left:
                warnings.warn(f"init_module(empty_init=True): {', '.join(sorted(left))} hold parameters or buffers "
                              f"but have no reset_parameters(), so they are left uninitialised on each rank's shard. "
                              f"Load a checkpoint into the model before training, give those modules a "
                              f"reset_parameters(), or build the model without empty_init.", stacklevel=3)
        return module

    def module_init_device(self, empty_init):
        """The meta device with empty_init=True: nothing is allocated until setup has sharded the module."""
        return torch.device("meta") if empty_init else self.device

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, **kwargs):
        """Shard the module, then point the optimizers at the sharded parameters that replaced theirs."""
        names = {id(p): name for name, p in module.named_parameters()}
        for opt in optimizers:
            if opt.state:
                raise CoreValueError("The optimizer has already taken steps; set it up before the first step.")
        self.setup_module(module, **kwargs)
        sharded = dict(module.named_parameters())
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return module, optimizers

    def check_optimizer(self, optimizer, module) -> None:
        from torch.distributed.tensor import DTensor

        sharded = {id(p) for p in module.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.device.type == "meta" or not isinstance(p, DTensor) or id(p) not in sharded:
                    raise CoreValueError(
                        "The optimizer was created from parameters that are not the sharded ones (it was built "
                        "before setup_module, or from meta-device parameters). Either set up jointly with "
                        "`fabric.setup(model, optimizer)`, or create the optimizer after "
                        "`model = fabric.setup_module(model)` from `model.parameters()`.")

    def parameter_shares(self):
        return ShardedParameters()

    @contextmanager
    def _gradient_sync(self, module, enabled: bool):
        module.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            module.module.set_requires_gradient_sync(True)

    def no_backward_sync(self, module):
        return self._gradient_sync(module, False)

    def keep_for_second_backward(self, module, optimizers: list) -> None:
        """FSDP2 frees each gathered parameter after its backward, but the gradient taken with create_graph
        holds them for the second backward: the model's parameters stay gathered until its optimizer steps
        (optimizer_step), however many gradients are taken before."""
        if not optimizers:
            raise CoreValueError(
                "fabric.grad under fsdp keeps the model's parameters gathered until its optimizer steps, "
                "and this model has none set up: set it up with its optimizer.")
        if id(module) in self._gathered:
            return
        shards = [m for m in module.module.modules() if hasattr(m, "set_reshard_after_backward")]
        for shard in shards:
            shard.set_reshard_after_backward(False, recurse=False)
        self._gathered[id(module)] = shards

    def optimizer_step(self, optimizer, module, **kwargs):
        result = super().optimizer_step(optimizer, module, **kwargs)
        for shard in self._gathered.pop(id(module), ()):  # kept for a second backward (fabric.grad): freed now
            shard.reshard()
            shard.set_reshard_after_backward(True, recurse=False)
        return result

    def clip_gradients(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type)  # over the shards: a DTensor to be reduced
        norm = total.full_tensor() if hasattr(total, "full_tensor") else total  # the same on every rank
        if error_if_nonfinite and not torch.isfinite(norm):
            raise CoreRuntimeError(
                f"The total norm of order {norm_type} of the gradients is {norm.item()}, so they "
                f"cannot be clipped. Pass error_if_nonfinite=False to clip_gradients to go on anyway.")
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return norm

    # checkpoints: sharded (core/checkpoint/sharded.py); a one-file or DeepSpeed checkpoint loads whole and is
    # sharded here
    def save_checkpoint(self, path, state: dict, group=None) -> None:
        from core.checkpoint import sharded
        sharded.save(path, state, self.global_rank, lambda: self.barrier(group=group),
                     lambda problem: self.stop_together(problem, group), group)

    def load_checkpoint(self, path, held=None) -> dict:
        """A sharded checkpoint is read straight into this rank's shards (`held()`: what `fabric.save` would
        write now, DTensors of this rank), resharded by DCP to this number of processes."""
        from core.checkpoint import sharded

        if held is None or not sharded.is_sharded(path):
            return super().load_checkpoint(path, held)
        tensors = sharded.load_into(path, held())
        return sharded.merge(tensors, sharded.read_rest(path))

    def module_state(self, wrapped) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(wrapped.module)  # this rank's shards, as DTensors

    def _load_state_dict(self, wrapped, state: dict, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        options = StateDictOptions(full_state_dict=not _sharded(state), strict=strict)
        set_model_state_dict(wrapped.module, state, options=options)

    def optimizer_state(self, optimizer, wrapped_module) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(wrapped_module.module, optimizer)

    def load_optimizer_state(self, optimizer, wrapped_module, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        if not state.get("state"):  # saved before its first step, which torch's loader cannot place ("device")
            optimizer.state.clear()
            for group, saved in zip(optimizer.param_groups, state["param_groups"]):
                group.update({key: value for key, value in saved.items() if key != "params"})
            return
        options = StateDictOptions(full_state_dict=not _sharded(state))
        set_optimizer_state_dict(wrapped_module.module, optimizer, state, options=options)


def _sharded(tree) -> bool:
    """Whether a state dict holds this rank's shards (DTensors) rather than full tensors."""
    from torch.distributed.tensor import DTensor
    if isinstance(tree, dict):
        return any(_sharded(value) for value in tree.values())
    return isinstance(tree, DTensor)
