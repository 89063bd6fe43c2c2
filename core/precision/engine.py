"""A mode under an engine that converts the module and scales the loss itself (DeepSpeed)."""
from contextlib import nullcontext

import torch

from core.precision.base import Precision, cast_floats
from core.precision.true import TruePrecision


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
