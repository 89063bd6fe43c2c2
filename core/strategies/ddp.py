"""DistributedDataParallel: gloo on CPU, NCCL on CUDA. Also the process group's set-up and core's collectives,
which fsdp and deepspeed inherit."""
import inspect
import warnings
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core import checkpoint, launcher
from core.errors import CoreRuntimeError, CoreTypeError, CoreValueError
from core.strategies.single import SingleDevice


def cuda_index(local_rank: int) -> int:
    """This rank's GPU: cuda:LOCAL_RANK, or cuda:0 where each rank sees only its own GPU (CUDA_VISIBLE_DEVICES
    set per rank, as SLURM and some clusters do), so that LOCAL_RANK exceeds the visible devices."""
    visible = torch.cuda.device_count()
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise CoreRuntimeError(
        f"LOCAL_RANK is {local_rank} but this process sees {visible} GPUs (cuda:0 to cuda:{visible - 1})"
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
        self.timeout_asked = timeout is not None
        self._background_group = None

    @staticmethod
    def _check_ddp_options(options: dict, where: str) -> None:
        accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module",
                                                                                          "device_ids"}
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise CoreTypeError(f"{where} got {unknown}, which DistributedDataParallel does not take. Its options: "
                                f"{', '.join(sorted(accepted))}.")

    def setup_environment(self, env: dict) -> None:
        self.global_rank, self.local_rank = env["global_rank"], env["local_rank"]
        self.world_size, self.node_rank = env["world_size"], env["node_rank"]
        if self.device.type == "cuda":
            self.device = torch.device("cuda", cuda_index(self.local_rank))
            torch.cuda.set_device(self.device)
        created = not dist.is_initialized()
        if created:
            # on CUDA, gloo serves CPU tensors beside nccl: the bounded exit barrier (monitored_barrier) needs it
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=self.global_rank, world_size=self.world_size,
                                    timeout=max(self.timeout, DEFAULT_TIMEOUT),  # the ranks' start-up may be slow
                                    store=launcher.own_store(),  # bound before the others started; see there
                                    device_id=self.device if self.device.type == "cuda" else None)
        if created or self.timeout_asked:  # a timeout asked of a Fabric made in a running group applies to it too
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

    def verify_checkpoint(self, path) -> str | None:
        """As one device's, with the files' checksums shared out among the ranks and every rank refusing together."""
        found, note = checkpoint.integrity.problems(path, self.global_rank, self.world_size)
        everyone = self._gather(found, "checking a checkpoint's checksums")
        return self._verdict(path, sorted({problem for found in everyone for problem in found}), note)

    def stop_together(self, problem: str | None, group=None) -> None:
        everyone = self._gather(problem, "agreeing on a save", group)
        super().stop_together(next((found for found in everyone if found is not None), None))

    def background_group(self):
        """A gloo group of every rank for background saves (made at the first, which every rank calls), so that
        their collectives never meet training's on the default group."""
        if self._background_group is None:
            self._background_group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._background_group

    def _gather(self, obj, what: str, group=None) -> list:
        """Every rank's `obj`, in rank order (a verdict all ranks then take together); `what`: for a timeout."""
        everyone = [None] * self.world_size
        with self._named_timeout(what):
            dist.all_gather_object(everyone, obj, group=group)
        return everyone

    def barrier(self, timeout: float | None = None, group=None) -> None:
        """All ranks meet; `timeout` (seconds) bounds the wait where it is not the process group's."""
        with self._named_timeout("barrier", timeout):
            if timeout is None:
                dist.barrier(group=group)
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
        raise CoreTypeError(f"timeout must be seconds or a datetime.timedelta, got {type(value).__name__}.")
    if value.total_seconds() <= 0:
        raise CoreValueError(f"timeout must be positive, got {value.total_seconds():g} s.")
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
