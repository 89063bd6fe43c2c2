"""Mixed precision: the forward under `torch.autocast`, weights and gradients in float32; 16-mixed adds a
loss scaler."""
import torch

from core.errors import CoreValueError
from core.precision.base import Precision, cast_floats


def check_bfloat16(name: str, device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise CoreValueError(
            f"precision={name!r} needs bfloat16, which {torch.cuda.get_device_name(device)} does not "
            f"support natively (emulated bfloat16 is slower than float32). Use '16-mixed' or '32-true'.")


class BFloat16Mixed(Precision):
    """The forward under `torch.autocast` to bfloat16; weights, gradients and outputs stay float32."""

    name = "bf16-mixed"
    dtype = torch.bfloat16
    passthrough = False

    def __init__(self, device: torch.device):
        super().__init__(device)
        if self.dtype == torch.bfloat16:
            check_bfloat16(self.name, device)

    def forward_context(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def convert_output(self, data):
        if type(data) is torch.Tensor:  # the common case without the walk: one output tensor
            return data.float() if data.is_floating_point() else data
        return cast_floats(data, torch.float32)

    def fsdp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def deepspeed_config(self) -> dict:
        return {"bf16": {"enabled": True}}


class Float16Mixed(BFloat16Mixed):
    """Autocast to float16, with one GradScaler for every optimizer, torch's recipe for several models (see
    Precision's loss scaling): a loss through two models is scaled once and unscaled by the same scale in each
    model's optimizer."""

    name = "16-mixed"
    dtype = torch.float16
    scales_loss = True

    def add_optimizer(self, optimizer) -> None:
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device_type)

    def fsdp_policy(self):
        raise CoreValueError("precision='16-mixed' is not supported with strategy='fsdp' (it would need a sharded loss "
                             "scaler). Use 'bf16-mixed', 'bf16-true' or '32-true'.")

    def deepspeed_config(self) -> dict:
        return {"fp16": {"enabled": True}}
