"""What a Fabric offers across processes: this process's place in the run (ranks, world size, device) and the
collectives (barrier, broadcast, all_reduce, all_gather), each asked of the Fabric's strategy; and `print` and
`to_device`, which depend on them. Fabric (core/fabric.py) is a Collectives."""
import torch

from core import validation
from core.nested import map_nested, move_to


class Collectives:
    """Rank information and collectives of a Fabric, through its `_strategy`."""

    def to_device(self, obj):
        """Move tensors and modules, also inside lists, tuples and dicts, to this process's device."""
        return move_to(obj, self.device)

    def print(self, *args, **kwargs) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        """All processes meet here. `name` (Lightning's argument) is only a label."""
        self._strategy.barrier()

    def broadcast(self, obj, src: int = 0):
        return self._strategy.broadcast(obj, src)

    def all_reduce(self, data, group=None, reduce_op="mean"):
        """Reduce a tensor, a number, or every tensor and number inside lists, tuples and dicts, across
        processes: reduce_op "mean" (or "avg"), "sum", "max", "min", "product", or a torch ReduceOp."""
        op = validation.reduce_op(reduce_op)
        return map_nested(self._tensors_on_device(data), lambda t: self._strategy.all_reduce(t, op, group))

    def all_gather(self, data, group=None, sync_grads: bool = False):
        """Gather a tensor (or every tensor in a collection) from every process: shape (world_size, *shape);
        on one process the data as it is. `sync_grads=True` lets gradients flow back through the gather."""
        return map_nested(self._tensors_on_device(data), lambda t: self._strategy.all_gather(t, group, sync_grads))

    def _tensors_on_device(self, data):
        return map_nested(data, lambda leaf: leaf.to(self.device) if isinstance(leaf, torch.Tensor) else
                          torch.as_tensor(leaf, device=self.device) if isinstance(leaf, (int, float)) else leaf)

    @property
    def device(self) -> torch.device:
        return self._strategy.device

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def strategy(self):
        return self._strategy
