"""What each process holds of a sharded module's parameters, per strategy: the object a strategy's
`parameter_shares()` returns and `setup` sets on each set-up module, for code that works on a process's own share
(common/ema.py's weight average, the finite-weights check). Where every process holds each parameter whole, the
strategy returns None (common/ema.py's WholeParameters stands in)."""
import torch


class ShardedParameters:
    """What each process holds of an FSDP2 module's parameters (common/ema.py's `parameter_shares`): DTensors,
    which shard themselves, so code that copies them (the EMA) gets sharded copies as they are; only a check
    of the values reads this process's shard directly (a DTensor's own reduction would be a collective)."""

    def local(self, param):
        return param

    def full(self, param, local):
        return local

    def part(self, param, full):
        return full

    def written(self, params: list) -> None:
        pass

    def finite(self, param) -> bool:
        local = param.to_local() if hasattr(param, "to_local") else param
        return bool(local.detach().isfinite().all())


class Zero3Shares:
    """What each process holds of a ZeRO-3 module's parameters (common/ema.py's `parameter_shares`): a flat,
    zero-padded slice `param.ds_tensor` of each one; the parameter itself is an empty placeholder."""

    def __init__(self, all_gather, rank: int):
        self.all_gather, self.rank = all_gather, rank

    def local(self, param):
        return param.ds_tensor if hasattr(param, "ds_tensor") else param

    def full(self, param, local):
        if not hasattr(param, "ds_tensor"):
            return local
        # (world, slice) -> the first numel elements, in the parameter's shape
        return self.all_gather(local).reshape(-1)[:param.ds_numel].view(param.ds_shape)

    def part(self, param, full):
        if not hasattr(param, "ds_tensor"):
            return full
        size = param.ds_tensor.numel()  # this rank's slice of the flat tensor, zero-padded
        flat = torch.nn.functional.pad(full.reshape(-1), (0, max(0, (self.rank + 1) * size - full.numel())))
        return flat[self.rank * size:(self.rank + 1) * size]

    def written(self, params: list) -> None:
        # ZeRO-3 keeps parameters under its persistence threshold gathered between steps; re-gather them from
        # the partitions just written, as its optimizer does after a step (a collective)
        persistent = [p for p in params if getattr(p, "ds_persist", False)]
        if persistent:
            persistent[0].partition(persistent)
            persistent[0].all_gather(persistent)

    def finite(self, param) -> bool:
        return bool(self.local(param).detach().isfinite().all())
