"""Strategies: how a module is wrapped, how gradients are synchronised, how state is saved.

`SingleDevice` is the base; `DDP` adds a process group and DistributedDataParallel. FSDP and
DeepSpeed live in `core/fsdp.py` and `core/deepspeed.py` and are imported only when chosen.
STRATEGIES maps each name to its class and options; a new strategy is one class and one entry there
(or `register_strategy(name, cls, **options)` from outside core).
"""
import importlib
import inspect
from datetime import timedelta
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core import checkpoint, launcher

class SingleDevice:
    """One process, one device. Every other strategy extends this one."""

    name = "single"  # set to its registry name when made by make_strategy
    distributed = False
    spawn = False  # True: launch(fn) runs fn in new processes instead of re-running the script
    joint_setup = False  # DeepSpeed needs model and optimizers together
    guard_submodules = False  # a wrapper that syncs gradients, which a child called directly would skip
    moves_module = True  # False where the engine places the module itself
    changes_module = False  # True where setup changes the module in place (sharding, an engine): set up once only
    backward_needs_module = False  # True where backward goes through the module's engine
    options_key = None  # the name of this strategy's per-module options in setup(..., ddp={...})

    def __init__(self, device: torch.device, precision, **options):
        if options and not self.distributed:
            raise TypeError(f"Fabric() got unknown argument(s) {sorted(options)}. It takes accelerator, strategy, "
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
            raise ValueError(f"{type(self).__name__} takes no per-module options, got {sorted(kwargs)}.")
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
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_val)

    # collectives: identities on one process
    def barrier(self, timeout: float | None = None) -> None:
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
    def save_checkpoint(self, path, state: dict) -> None:
        if self.global_rank == 0:
            checkpoint.save_file(state, path)
        self.barrier()

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
        optimizer.load_state_dict(checkpoint.indexed_optimizer_state(state, self.parameter_names(optimizer,
                                                                                                 wrapped_module)))

    def teardown(self) -> None:
        pass


def cuda_index(local_rank: int) -> int:
    """This rank's GPU: cuda:LOCAL_RANK, or cuda:0 where each rank sees only its own GPU (CUDA_VISIBLE_DEVICES
    set per rank, as SLURM and some clusters do), so that LOCAL_RANK exceeds the visible devices."""
    visible = torch.cuda.device_count()
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise RuntimeError(f"LOCAL_RANK is {local_rank} but this process sees {visible} GPUs (cuda:0 to cuda:{visible - 1})"
                       f": start at most {visible} processes per node, or give each process its own GPU with "
                       f"CUDA_VISIBLE_DEVICES.")


class DDP(SingleDevice):
    """DistributedDataParallel: gloo on CPU, NCCL on CUDA. Per-module options (find_unused_parameters,
    broadcast_buffers, ...) go to that module's DDP wrapper only."""

    distributed = True
    guard_submodules = True
    options_key = "ddp"

    def __init__(self, device, precision, timeout=None, **options):
        """`timeout`: how long a process waits in a collective for the others (seconds or a timedelta; Lightning's
        DDPStrategy(timeout=...)), DEFAULT_TIMEOUT when None. A rank that waits longer stops with one line naming it."""
        super().__init__(device, precision, **options)
        self._check_ddp_options(options, "Fabric()")
        self.timeout = collective_timeout(timeout)

    @staticmethod
    def _check_ddp_options(options: dict, where: str) -> None:
        accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module",
                                                                                          "device_ids"}
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TypeError(f"{where} got {unknown}, which DistributedDataParallel does not take. Its options: "
                            f"{', '.join(sorted(accepted))}.")

    def setup_environment(self, env: dict) -> None:
        self.global_rank, self.local_rank = env["global_rank"], env["local_rank"]
        self.world_size, self.node_rank = env["world_size"], env["node_rank"]
        if self.device.type == "cuda":
            self.device = torch.device("cuda", cuda_index(self.local_rank))
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            # on CUDA, gloo serves CPU tensors beside nccl: the bounded exit barrier (monitored_barrier) needs it
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size,
                                    timeout=max(self.timeout, DEFAULT_TIMEOUT),  # the ranks' start-up may be slow
                                    store=launcher.own_store(),  # bound before the others started; see there
                                    device_id=self.device if self.device.type == "cuda" else None)
            # for the collectives from here on (torch < 2.8 has the same under its older, private name)
            (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(self.timeout)

    def setup_module(self, module: nn.Module, **kwargs) -> nn.Module:
        if not any(p.requires_grad for p in module.parameters()):
            return module  # nothing to synchronise; DDP would refuse it
        self._check_ddp_options(kwargs, "setup(..., ddp={...})")
        options = {**self.options, **kwargs}
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        with warnings.catch_warnings():
            # torch 2.14 deprecates broadcast_buffers for forward_sync_buffers, which also syncs buffers at
            # construction; its own warning says to keep broadcast_buffers=False for rank-local buffers. The
            # option is passed on as given, so its deprecation is not the user's to act on here.
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            return DistributedDataParallel(module, device_ids=device_ids, **options)

    def no_backward_sync(self, module):
        forward = module._forward_module
        return forward.no_sync() if isinstance(forward, DistributedDataParallel) else nullcontext()

    def barrier(self, timeout: float | None = None) -> None:
        """All ranks meet; `timeout` (seconds) bounds the wait where it is not the process group's."""
        with self._named_timeout("barrier", timeout):
            if timeout is None:
                dist.barrier()
            else:  # gloo's barrier with its own bound (on CUDA the group has gloo beside nccl for this)
                dist.monitored_barrier(timeout=timedelta(seconds=timeout))

    def all_reduce(self, tensor, op, group=None):
        """`op`: a torch ReduceOp, or "mean" (a sum divided by the number of processes)."""
        tensor = tensor.clone()
        with self._named_timeout("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "mean" else op, group=group)
        return tensor / dist.get_world_size(group) if op == "mean" else tensor

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        if sync_grads:
            return _GatherWithGradients.apply(tensor, group)
        tensor = tensor.contiguous()  # empty_like keeps strides: the buffers must be contiguous too
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    def broadcast(self, obj, src: int = 0):
        box = [obj]
        with self._named_timeout(f"broadcast from rank {src}"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    @contextmanager
    def _named_timeout(self, what: str, seconds: float | None = None):
        """Turn the backend's timeout of a collective of core's into a TimeoutError that names the setting
        (`seconds`: a bound of the call's own instead of the collective timeout)."""
        try:
            yield
        except RuntimeError as error:
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                raise
            setting = ("the collective timeout; raise it with --collective-timeout SECONDS, or Fabric(timeout=...)"
                       if seconds is None else "this wait's own bound")
            seconds = self.timeout.total_seconds() if seconds is None else seconds
            raise TimeoutError(f"rank {self.global_rank} waited more than {seconds:g} s for the other ranks in {what} "
                               f"({setting}): another rank is slower by that much (long work on one rank, such as "
                               f"rank 0's evaluation) or is stuck") from error

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's gloo default; NCCL's own is 10 minutes


def collective_timeout(value) -> timedelta:
    """A collective timeout given in seconds or as a timedelta (None: DEFAULT_TIMEOUT)."""
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta):
        raise TypeError(f"timeout must be seconds or a datetime.timedelta, got {type(value).__name__}.")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value.total_seconds():g} s.")
    return value


class _GatherWithGradients(torch.autograd.Function):
    """all_gather whose backward hands each rank the summed gradient of its own slice."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()  # empty_like keeps strides: the buffers must be contiguous too
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class DDPSpawn(DDP):
    """DDP in processes started by `fabric.launch(fn)` through torch.multiprocessing (`start_method` "fork" for
    ddp_fork and ddp_notebook, as Lightning names them: fork works from a notebook, where spawn cannot import
    the function)."""

    spawn = True

    def __init__(self, device, precision, start_method: str = "spawn", **options):
        super().__init__(device, precision, **options)
        self.start_method = start_method


class DataParallel(SingleDevice):
    """Lightning's `dp`: one process running the module on every visible GPU through torch.nn.DataParallel
    (on the CPU, DataParallel passes the call through). torch recommends ddp over it."""

    guard_submodules = True

    def setup_module(self, module: nn.Module, **kwargs) -> nn.Module:
        super().setup_module(module, **kwargs)
        return nn.DataParallel(module) if self.device.type == "cuda" else module


# name -> (class or "module:Class", options it is made with); the module is imported when the name is chosen
STRATEGIES = {
    "single": (SingleDevice, {}),
    "ddp": (DDP, {}),
    "ddp_spawn": (DDPSpawn, {}),
    "ddp_fork": (DDPSpawn, {"start_method": "fork"}),
    "ddp_notebook": (DDPSpawn, {"start_method": "fork"}),
    "ddp_find_unused_parameters_true": (DDP, {"find_unused_parameters": True}),
    "dp": (DataParallel, {}),
    "fsdp": ("core.fsdp:FSDP", {}),
    "deepspeed": ("core.deepspeed:DeepSpeed", {"stage": None}),  # the stage from the config, else 2
    "deepspeed_stage_1": ("core.deepspeed:DeepSpeed", {"stage": 1}),
    "deepspeed_stage_2": ("core.deepspeed:DeepSpeed", {"stage": 2}),
    "deepspeed_stage_3": ("core.deepspeed:DeepSpeed", {"stage": 3}),
    "deepspeed_stage_2_offload": ("core.deepspeed:DeepSpeed", {"stage": 2, "offload": True}),
    "deepspeed_stage_3_offload": ("core.deepspeed:DeepSpeed", {"stage": 3, "offload": True}),
}


# Lightning's other names, for ported scripts (the training scripts' --strategy does not offer them)
LIGHTNING_NAMES = ("ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true", "dp")


def register_strategy(name: str, strategy, **options) -> None:
    """Make `Fabric(strategy=name)` build `strategy(device, precision, **options, **user_options)`;
    `strategy` is a subclass of SingleDevice, or "module:Class" to import when the name is chosen."""
    if not (isinstance(strategy, str) or isinstance(strategy, type) and issubclass(strategy, SingleDevice)):
        raise TypeError(f"A strategy is a subclass of core.strategies.SingleDevice (or 'module:Class'), "
                        f"got {strategy!r}.")
    if name == "auto":
        raise ValueError("'auto' is not a strategy's name: it picks single or ddp by the number of processes.")
    STRATEGIES[name] = (strategy, options)


def make_strategy(name: str, device: torch.device, precision, user_options: dict) -> SingleDevice:
    if name not in STRATEGIES:
        raise ValueError(f"Unknown strategy {name!r}. Choose one of: {', '.join(['auto', *STRATEGIES])}.")
    cls, options = STRATEGIES[name]
    if isinstance(cls, str):
        module, _, class_name = cls.partition(":")
        cls = getattr(importlib.import_module(module), class_name)
    fixed = sorted(set(options) & set(user_options))
    if fixed:
        raise ValueError(f"strategy={name!r} sets {fixed} itself; drop them, or choose a strategy whose name does "
                         f"not fix them.")
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        takes = sorted(set(parameters) - {"self", "device", "precision"} - set(options))
        unknown = sorted(set(user_options) - set(takes))
        if unknown:
            raise TypeError(f"Fabric() got {unknown}, which strategy={name!r} does not take. Its options: "
                            f"{', '.join(takes) or 'none'}.")
    strategy = cls(device, precision, **options, **user_options)
    strategy.name = name
    return strategy


@contextmanager
def frozen_parameters(modules):
    """Turn off requires_grad on every parameter of `modules` that has it, and restore it after."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
