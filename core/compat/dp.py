"""Lightning's `dp`: torch.nn.DataParallel in one process (a name of the drop-in, core.compat)."""
from torch import nn

from core.strategies.single import SingleDevice


class DataParallel(SingleDevice):
    """Lightning's `dp`: one process running the module on every visible GPU through torch.nn.DataParallel
    (on the CPU, DataParallel passes the call through). torch recommends ddp over it."""

    guard_submodules = True

    def setup_module(self, module: nn.Module, **kwargs) -> nn.Module:
        super().setup_module(module, **kwargs)
        return nn.DataParallel(module) if self.device.type == "cuda" else module
