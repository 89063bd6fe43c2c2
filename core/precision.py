"""Precision modes: autocast, input/output casting, and one loss scaler per optimizer for 16-mixed."""
from contextlib import nullcontext

import torch

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
           "bf16-true": torch.bfloat16}


def map_nested(data, fn):
    """`fn` applied to every leaf inside nested lists, tuples (named ones too) and dicts, structure kept.
    (torch.utils._pytree does this too, but is private and ~6x slower on a forward's (args, kwargs).)"""
    if isinstance(data, (list, tuple)):
        mapped = [map_nested(item, fn) for item in data]
        return type(data)(*mapped) if hasattr(data, "_fields") else type(data)(mapped)
    if isinstance(data, dict):
        return {key: map_nested(value, fn) for key, value in data.items()}
    return fn(data)


def _cast_floats(data, dtype):
    """Cast every floating-point tensor inside nested lists, tuples and dicts to `dtype`."""
    def cast(leaf):
        is_other_float = isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype
        return leaf.to(dtype) if is_other_float else leaf
    return map_nested(data, cast)


class Precision:
    """What a precision string means for forward, backward and the optimizer step.

    `32-true` does nothing at all, so the single-device fast path stays a plain call. Mixed modes
    run the forward under `torch.autocast` and hand float32 outputs back; `*-true` modes convert the
    module and cast float inputs. `16-mixed` keeps one GradScaler per optimizer, so an overflow in
    one model's backward lowers only that model's loss scale.
    """

    def __init__(self, precision: str, device: torch.device):
        if precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {precision!r}. Choose one of: {', '.join(PRECISIONS)}.")
        if precision.startswith("bf16") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"precision={precision!r} needs bfloat16, which {torch.cuda.get_device_name(device)}"
                             " does not support. Use '16-mixed' or '32-true'.")
        self.precision = precision
        self.device_type = device.type
        self.dtype = _DTYPES[precision]
        self.mixed = precision.endswith("-mixed")  # float32 outputs
        self.autocast = self.mixed  # a strategy that converts the module itself turns this off
        self.input_dtype = self.dtype if precision == "bf16-true" else None
        self.use_scalers = precision == "16-mixed"  # a strategy with its own loss scaling turns this off
        self.scalers = {}  # id(optimizer) -> torch.amp.GradScaler, 16-mixed only

    @property
    def is_default(self) -> bool:
        return self.precision == "32-true"

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.autocast else nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.dtype) if self.precision == "bf16-true" else module

    def convert_input(self, data):
        return _cast_floats(data, self.input_dtype) if self.input_dtype is not None else data

    def convert_output(self, data):
        return _cast_floats(data, torch.float32) if self.mixed else data

    def add_optimizer(self, optimizer) -> None:
        if self.use_scalers:
            self.scalers[id(optimizer)] = torch.amp.GradScaler(self.device_type)

    def scale_loss(self, loss: torch.Tensor, optimizer_id: int | None) -> torch.Tensor:
        if not self.scalers:
            return loss
        return self.scalers[optimizer_id].scale(loss)

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
