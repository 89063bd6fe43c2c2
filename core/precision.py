"""Precision modes, one class each: what a mode does to the forward, the backward and the optimizer step.

`Precision` is 32-true and the base of every mode: each method is what 32-true does (nothing), and a mode
overrides only what it changes. A strategy that does part of the work itself asks the mode for its
variant instead of editing it: FSDP for `fsdp_policy()`, DeepSpeed for `deepspeed_config()` and
`under_engine()`. PRECISIONS maps each name to its class; a new mode is one class and one entry here
(or `register_precision(name, cls)` from outside core).
"""
from contextlib import contextmanager, nullcontext

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

    def add_optimizer(self, optimizer) -> None:
        pass

    def scale_loss(self, loss: torch.Tensor, optimizer_id: int) -> torch.Tensor:
        scaler = self.scalers.get(optimizer_id)
        return scaler.scale(loss) if scaler is not None else loss

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

    def under_engine(self) -> "Precision":
        """This mode where an engine converts the module and scales the loss itself (DeepSpeed)."""
        return EnginePrecision(self)


def _check_bfloat16(name: str, device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"precision={name!r} needs bfloat16, which {torch.cuda.get_device_name(device)} does not "
                         f"support natively (emulated bfloat16 is slower than float32). Use '16-mixed' or '32-true'.")


class BFloat16Mixed(Precision):
    """The forward under `torch.autocast` to bfloat16; weights, gradients and outputs stay float32."""

    name = "bf16-mixed"
    dtype = torch.bfloat16
    passthrough = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        if self.dtype == torch.bfloat16:
            _check_bfloat16(self.name, device)

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def convert_output(self, data):
        return cast_floats(data, torch.float32)

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def deepspeed_config(self) -> dict:
        return {"bf16": {"enabled": True}}


class Float16Mixed(BFloat16Mixed):
    """Autocast to float16, with one GradScaler per optimizer: an overflow in one model's backward
    lowers only that model's loss scale."""

    name = "16-mixed"
    dtype = torch.float16

    def add_optimizer(self, optimizer) -> None:  # (set up again: it keeps its scale)
        self.scalers.setdefault(id(optimizer), torch.amp.GradScaler(self.device_type))

    def fsdp_policy(self):
        raise ValueError("precision='16-mixed' is not supported with strategy='fsdp' (it would need a sharded loss "
                         "scaler). Use 'bf16-mixed', 'bf16-true' or '32-true'.")

    def deepspeed_config(self) -> dict:
        return {"fp16": {"enabled": True}}


class TruePrecision(Precision):
    """The module converted to `dtype`, float inputs cast to it, and `dtype` the default dtype inside its
    forward (a tensor the forward creates, `torch.ones(3)`, is in it too) and in `init_module()`. The outputs
    are handed back in the default dtype outside (float32), as Lightning's true precisions do, so a loss is
    computed the same way whatever the mode."""

    passthrough = False

    def convert_module(self, module):
        return module.to(self.dtype)

    def convert_input(self, data):
        return cast_floats(data, self.dtype)

    def convert_output(self, data):
        return cast_floats(data, torch.get_default_dtype())

    @contextmanager
    def forward_context(self):
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    def init_context(self):
        return self.forward_context()


class BFloat16True(TruePrecision):
    name = "bf16-true"
    dtype = torch.bfloat16

    def __init__(self, device: torch.device):
        super().__init__(device)
        _check_bfloat16(self.name, device)

    def deepspeed_config(self) -> dict:
        return {"bf16": {"enabled": True}}


class Float16True(TruePrecision):
    """No loss scaling: small gradients may underflow to zero."""

    name = "16-true"
    dtype = torch.float16

    def deepspeed_config(self) -> dict:
        return {"fp16": {"enabled": True}}


class Float64True(TruePrecision):
    """For numerical checks, not speed."""

    name = "64-true"
    dtype = torch.float64

    def deepspeed_config(self) -> dict:
        raise ValueError("DeepSpeed has no float64 mode. Use precision='32-true' (or a bf16/16 mode) under deepspeed.")


class EnginePrecision(Precision):
    """A mode under an engine that converts the module and scales the loss itself: core only casts the
    inputs to the module's dtype, and hands mixed modes' outputs back in float32."""

    def __init__(self, mode: Precision):
        super().__init__(torch.device(mode.device_type))
        self.mode = mode
        self.name, self.dtype = mode.name, mode.dtype
        self.passthrough = mode.passthrough

    def convert_input(self, data):
        return data if self.passthrough else cast_floats(data, self.dtype)

    def forward_context(self):  # a true mode's default dtype; the engine itself runs a mixed mode's module
        return self.mode.forward_context() if isinstance(self.mode, TruePrecision) else nullcontext()

    def convert_output(self, data):
        return self.mode.convert_output(data)

    def deepspeed_config(self) -> dict:
        return self.mode.deepspeed_config()


PRECISIONS = {mode.name: mode for mode in (Precision, BFloat16Mixed, Float16Mixed, BFloat16True, Float16True,
                                           Float64True)}
ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's older names


def register_precision(name: str, mode: type) -> None:
    """Make `Fabric(precision=name)` build `mode(device)`, a subclass of Precision."""
    if not (isinstance(mode, type) and issubclass(mode, Precision)):
        raise TypeError(f"A precision mode is a subclass of core.precision.Precision, got {mode!r}.")
    PRECISIONS[name] = mode


def make_precision(name, device: torch.device) -> Precision:
    """The mode named `name` (a name in PRECISIONS, an alias in ALIASES, or the int 16, 32 or 64)."""
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(f"Unknown precision {name!r}. Choose one of: {', '.join(PRECISIONS)} (or the aliases "
                         f"{', '.join(ALIASES)}, also as ints).")
    mode = PRECISIONS[name](device)
    mode.name = name  # the name it was registered under
    return mode
