"""An exponential moving average of a module's weights that works on each process's own share of them.

    ema = EMA(generator, decay=0.999)                       # after setup: under fsdp, the sharded parameters
    ema.update()                                            # after every optimizer step of `generator`
    with ema.swapped_in():                                  # the average in the parameters, for sampling
        images = generator(noise)

torch.optim.swa_utils.AveragedModel deep-copies the module, which a sharded one cannot be. This keeps a
float32 copy of each parameter's local storage instead: the parameter itself (single, ddp, ZeRO 1 and 2,
where every process holds it whole), its DTensor (fsdp: the copy is sharded like the parameter, and the
checkpoint saves it sharded), or ZeRO-3's partition `param.ds_tensor` (the parameter is an empty
placeholder). Floating-point buffers (BatchNorm's running statistics) are averaged with the weights, as
`AveragedModel(use_buffers=True)` does: the average generator in eval mode then normalises with statistics
of about the same weights (with the raw module's statistics, a digits run scored FID 2.51 against 1.06
raw). Other buffers (the batch counter) stay the module's.

The state dict is keyed by parameter name. Under ZeRO-3, where each process holds a flat slice, `gather`
(fabric.all_gather) makes full tensors of the slices for the checkpoint, which only rank 0 writes, and
`rank` picks this process's slice again on load; both are collectives that every process reaches together.
"""
from contextlib import contextmanager

import torch
import torch.nn.functional as F


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The storage this process holds of `param`: ZeRO-3's partition, or the parameter (a DTensor under fsdp)."""
    return param.ds_tensor if hasattr(param, "ds_tensor") else param


class EMA:
    def __init__(self, module: torch.nn.Module, decay: float, gather=None, rank: int = 0):
        """`decay` 0 turns the average off: no copies, `update` and `swapped_in` do nothing."""
        if not 0 <= decay < 1:
            raise ValueError(f"the EMA decay must be in [0, 1), got {decay}")
        self.decay, self.gather, self.rank = decay, gather, rank  # no `module` attribute: save_plain would unwrap it
        floating = {name: b for name, b in module.named_buffers() if b.is_floating_point()}
        self.params = {**dict(module.named_parameters()), **floating} if decay else {}  # the averaged tensors
        with torch.no_grad():
            self.averages = {name: local_tensor(p).detach().float().clone() for name, p in self.params.items()}
        self.updates = 0

    def current_decay(self) -> float:
        """The decay of the next update: `decay`, held lower while few updates have been made, min(decay,
        (1 + n) / (10 + n)) at update n (TensorFlow's ExponentialMovingAverage with num_updates), so the average
        is not dominated by the initial weights for the first ~1/(1 - decay) steps (at 0.999 and step 1000 it
        would still be 37% initialisation)."""
        n = self.updates + 1
        return min(self.decay, (1 + n) / (10 + n))

    @torch.no_grad()
    def update(self) -> None:
        """average <- d * average + (1 - d) * weights, for every parameter and float buffer (d: current_decay)."""
        if self.averages:
            weight = 1 - self.current_decay()
            for average, p in zip(self.averages.values(), self.params.values()):  # one by one: under fsdp the
                average.lerp_(local_tensor(p).float(), weight)  # parameters are DTensors, the buffers are not
            self.updates += 1

    @contextmanager
    def swapped_in(self):
        """Within: the module's parameters hold the averages (cast to their dtype); afterwards the raw weights."""
        if not self.averages:
            yield
            return
        with torch.no_grad():
            raw = {name: local_tensor(p).clone() for name, p in self.params.items()}
            self._write(self.averages)
        try:
            yield
        finally:
            with torch.no_grad():
                self._write(raw)

    def _write(self, values: dict) -> None:
        for name, p in self.params.items():
            local_tensor(p).copy_(values[name])
        # ZeRO-3 keeps parameters under its persistence threshold gathered between steps; re-gather them from
        # the partitions just written, as its optimizer does after a step (a collective)
        persistent = [p for p in self.params.values() if getattr(p, "ds_persist", False)]
        if persistent:
            persistent[0].partition(persistent)
            persistent[0].all_gather(persistent)

    def state_dict(self) -> dict:
        """{name: average}: full tensors, or DTensors under fsdp (checkpointed sharded); ZeRO-3's slices are
        gathered into full tensors of the parameter's shape."""
        state = {}
        for name, average in self.averages.items():
            p = self.params[name]
            if hasattr(p, "ds_tensor"):  # (world, slice) -> the first numel elements, in the parameter's shape
                average = self.gather(average).reshape(-1)[:p.ds_numel].view(p.ds_shape)
            state[name] = average
        return {**state, "updates": self.updates} if self.averages else state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.updates = int(state.pop("updates", 0))
        if set(state) != set(self.averages):
            raise ValueError(f"the checkpoint's EMA holds {len(state)} averages, this generator has "
                             f"{len(self.averages)} parameters; resume with the --ema-decay of the run that saved it")
        for name, average in self.averages.items():
            value = state[name]
            if hasattr(self.params[name], "ds_tensor"):  # this rank's slice of the flat tensor, zero-padded
                size = average.numel()
                flat = F.pad(value.reshape(-1), (0, max(0, (self.rank + 1) * size - value.numel())))
                value = flat[self.rank * size:(self.rank + 1) * size]
            average.copy_(value)
