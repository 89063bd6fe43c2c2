"""The base precision, 32-true, and what every mode shares: the casts of nested data and the loss scaler.

`Precision` is 32-true and the base of every mode: each method is what 32-true does (nothing), and a mode
overrides only what it changes. Every precision decision is the mode's: the casts, and how a loss and an
optimizer's step go through the loss scaler (`scale_loss`, `input_gradients`, `optimizer_step`). A strategy
that does part of the work itself asks the mode for its variant instead of editing it: FSDP for
`fsdp_policy()`, DeepSpeed for `deepspeed_config()`.
"""
from contextlib import nullcontext

import torch

from core.errors import CoreValueError
from core.nested import map_nested
from core.shared import resolve, share


def cast_floats(data, dtype):
    """Cast every floating-point tensor inside nested lists, tuples and dicts to `dtype`."""
    def cast(leaf):
        is_other_float = isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype
        return leaf.to(dtype) if is_other_float else leaf
    return map_nested(data, cast)


class ModeForward:
    """`module`'s forward under `mode` (Precision.forward_of). An object rather than a closure, so that copying a
    set-up module (`copy.deepcopy`, pickle) copies the module it calls, and shares the mode (core/shared.py)."""

    __slots__ = ("module", "mode")

    def __init__(self, module: torch.nn.Module, mode: "Precision"):
        self.module, self.mode = module, mode

    def __getstate__(self):
        return share({name: getattr(self, name) for name in self.__slots__}, "mode")

    def __setstate__(self, state):
        for name, value in resolve(state, "mode").items():
            setattr(self, name, value)

    def __call__(self, *args, **kwargs):
        mode = self.mode
        args, kwargs = mode.convert_input((args, kwargs))
        with mode.forward_context():
            output = self.module(*args, **kwargs)
        return mode.convert_output(output)


class Precision:
    """32-true: float32 everywhere, nothing added, so the single-device fast path stays a plain call."""

    name = "32-true"
    dtype = torch.float32
    passthrough = True  # forward, backward and step are the user's own calls; a mode that adds work says False
    scales_loss = False  # True where backward must take the scaled loss, so loss.backward() alone is not enough

    def __init__(self, device: torch.device):
        self.device_type = device.type
        self.scaler = None  # one torch.amp.GradScaler for every optimizer, in modes that scale the loss
        self._update_due = False  # an optimizer stepped through the scaler since its last update()

    def forward_context(self):
        return nullcontext()

    def init_context(self):
        """Within: new modules are created the way convert_module would leave them (Fabric.init_module)."""
        return nullcontext()

    def forward_of(self, module: torch.nn.Module):
        """`module`'s forward under this mode as one callable (a set-up module's forward): the inputs converted, the
        forward in the mode's context, the outputs converted; the module itself where the mode converts nothing."""
        return module if self.passthrough else ModeForward(module, self)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, data):
        return data

    def convert_output(self, data):
        return data

    # --- loss scaling: one scaler for all optimizers, in modes that add it (add_optimizer) ---------------
    # torch's recipe for several models and optimizers: one GradScaler, `scaler.step(opt)` for each optimizer,
    # `scaler.update()` after the steps. The update waits until the next loss is scaled, so every optimizer that
    # steps on one backward's gradients (a loss through two models, each with its own optimizer) unscales them
    # by the scale that backward used, and a backward-then-step per model (a GAN) updates after each step.
    def add_optimizer(self, optimizer) -> None:
        pass

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale; `loss` itself where no scaler is."""
        if self.scaler is None:
            return loss
        self._update_scale()
        return self.scaler.scale(loss)

    def _update_scale(self) -> None:
        if self._update_due:
            self.scaler.update()
            self._update_due = False

    def input_gradients(self, outputs, inputs, grad_outputs, create_graph: bool) -> tuple:
        """`torch.autograd.grad` for a penalty on gradients (fabric.grad): under a scaler the outputs are scaled
        by the loss scale and the gradients unscaled, so an overflow leaves inf in them and the scaler skips
        that step as it would for the loss."""
        scaler = self.scaler
        if scaler is not None:
            self._update_scale()
            outputs = map_nested(outputs, scaler.scale)
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, create_graph=create_graph)
        if scaler is None:
            return grads
        scale = scaler.get_scale()
        return tuple(g / scale if g is not None else None for g in grads)

    def unscale_gradients(self, optimizer) -> None:
        if self.scaler is not None and _has_gradients(optimizer):  # (without: nothing to unscale, and no step through
            self.scaler.unscale_(optimizer)                         # the scaler follows to reset it: optimizer_step)

    def optimizer_step(self, optimizer, **kwargs):
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if "closure" not in kwargs and not _has_gradients(optimizer):
            # nothing to unscale (its layers frozen, or not in this loss): GradScaler.step would assert ("No inf
            # checks were recorded"); the optimizer's own step, which skips parameters without gradients
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)  # skipped when this optimizer's gradients hold inf or NaN
        self._update_due = True
        return result

    def state_dict(self, optimizer) -> dict | None:
        """The loss scaler's state (the same for every optimizer), as the steps so far leave it."""
        if self.scaler is None:
            return None
        self._update_scale()
        return self.scaler.state_dict()

    def load_state_dict(self, optimizer, state: dict | None) -> None:
        if self.scaler is not None and state:
            self._update_scale()
            self.scaler.load_state_dict(state)

    # --- what strategies that do part of the work ask for ------------------------------------------
    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this mode, or None for none."""
        return None

    def deepspeed_config(self) -> dict:
        """The DeepSpeed config entries of this mode (a mode in another dtype than float32 must say its own)."""
        if self.dtype != torch.float32:
            raise CoreValueError(f"precision={self.name!r} has no DeepSpeed config: its class does not define "
                                 f"deepspeed_config(), so the engine would run in float32 on {self.dtype} inputs.")
        return {}


def _has_gradients(optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
