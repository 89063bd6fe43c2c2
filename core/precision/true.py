"""True precision: the module itself converted to a dtype (bf16-true, 16-true, 64-true)."""
from contextlib import contextmanager

import torch

from core.errors import CoreValueError
from core.precision.base import Precision, cast_floats
from core.precision.mixed import check_bfloat16


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
        check_bfloat16(self.name, device)

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
        raise CoreValueError(
            "DeepSpeed has no float64 mode. Use precision='32-true' (or a bf16/16 mode) under deepspeed.")
