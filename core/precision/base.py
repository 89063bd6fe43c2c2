"""The base precision, 32-true, and what every mode shares: the casts of nested data and the loss scalers.

`Precision` is 32-true and the base of every mode: each method is what 32-true does (nothing), and a mode
overrides only what it changes. Every precision decision is the mode's: the casts, and which loss scaler a loss
or an optimizer goes through (`scale_loss`, `input_gradients`, `optimizer_step`); Fabric and the strategies
only hand it the optimizers of the model a loss is for. A strategy that does part of the work itself asks
the mode for its variant instead of editing it: FSDP for `fsdp_policy()`, DeepSpeed for `deepspeed_config()`.
"""
from contextlib import nullcontext

import torch


def map_nested(data, fn):
    """`fn` applied to every leaf inside nested lists, tuples (named ones too) and dicts, structure kept.
    (torch.utils._pytree does this too, but is private and ~6x slower on a forward's (args, kwargs).)"""
    if isinstance(data, (list, tuple)):
        mapped = [map_nested(item, fn) for item in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    if isinstance(data, dict):
        return {key: map_nested(value, fn) for key, value in data.items()}
    return fn(data)


def cast_floats(data, dtype):
    """Cast every floating-point tensor inside nested lists, tuples and dicts to `dtype`."""
    def cast(leaf):
        is_other_float = isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype
        return leaf.to(dtype) if is_other_float else leaf
    return map_nested(data, cast)


class Precision:
    """32-true: float32 everywhere, nothing added, so the single-device fast path stays a plain call."""

    name = "32-true"
    dtype = torch.float32
    passthrough = True  # forward, backward and step are the user's own calls; a mode that adds work says False

    def __init__(self, device: torch.device):
        self.device_type = device.type
        self.scalers = {}  # id(optimizer) -> torch.amp.GradScaler, for modes that scale the loss

    def forward_context(self):
        return nullcontext()

    def init_context(self):
        """Within: new modules are created the way convert_module would leave them (Fabric.init_module)."""
        return nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, data):
        return data

    def convert_output(self, data):
        return data

    # --- loss scaling: one scaler per optimizer, in modes that add them (add_optimizer) -----------------
    def add_optimizer(self, optimizer) -> None:
        pass

    def steps_through_scaler(self, optimizer) -> bool:
        """True when `optimizer.step()` must go through `optimizer_step` (its scaler) rather than be its own."""
        return id(optimizer) in self.scalers

    def needs_loss_owner(self) -> bool:
        """True when scaling a loss needs the optimizers of the model it is for (several scalers)."""
        return len(self.scalers) > 1

    def scale_loss(self, loss: torch.Tensor, optimizers: list | None = None) -> torch.Tensor:
        """`loss` times the loss scale of the optimizer that steps the model it is for (`optimizers`: that
        model's set-up optimizers, needed where `needs_loss_owner()`); `loss` itself where no scaler is."""
        scaler = self._scaler_for(optimizers, "the model this loss is for")
        return loss if scaler is None else scaler.scale(loss)

    def input_gradients(self, outputs, inputs, grad_outputs, create_graph: bool, optimizers: list) -> tuple:
        """`torch.autograd.grad` for a penalty on gradients (fabric.grad): under a scaler the outputs are scaled
        by the model's loss scale and the gradients unscaled, so an overflow leaves inf in them and the scaler
        skips that step as it would for the loss."""
        scaler = self._scaler_for(optimizers, "the model these outputs come from")
        if scaler is not None:
            outputs = map_nested(outputs, scaler.scale)
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, create_graph=create_graph)
        if scaler is None:
            return grads
        scale = scaler.get_scale()
        return tuple(g / scale if g is not None else None for g in grads)

    def _scaler_for(self, optimizers: list | None, what: str):
        if len(self.scalers) <= 1:
            return next(iter(self.scalers.values()), None)
        if optimizers is None or len(optimizers) != 1:
            raise ValueError(f"{self.name} keeps one loss scale per optimizer, and {what} has "
                             f"{len(optimizers or [])} optimizers; set up one optimizer per model under {self.name}.")
        return self.scalers[id(optimizers[0])]

    def unscale_gradients(self, optimizer) -> None:
        scaler = self.scalers.get(id(optimizer))
        if scaler is not None:
            scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer, **kwargs):
        scaler = self.scalers.get(id(optimizer))
        if scaler is None:
            return optimizer.step(**kwargs)
        result = scaler.step(optimizer, **kwargs)
        scaler.update()
        return result

    def state_dict(self, optimizer) -> dict | None:
        scaler = self.scalers.get(id(optimizer))
        return scaler.state_dict() if scaler is not None else None

    def load_state_dict(self, optimizer, state: dict | None) -> None:
        scaler = self.scalers.get(id(optimizer))
        if scaler is not None and state:
            scaler.load_state_dict(state)

    # --- what strategies that do part of the work ask for ------------------------------------------
    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this mode, or None for none."""
        return None

    def deepspeed_config(self) -> dict:
        """The DeepSpeed config entries of this mode (a mode in another dtype than float32 must say its own)."""
        if self.dtype != torch.float32:
            raise ValueError(f"precision={self.name!r} has no DeepSpeed config: its class does not define "
                             f"deepspeed_config(), so the engine would run in float32 on {self.dtype} inputs.")
        return {}
