"""Precision modes, one class each: what a mode does to the forward, the backward and the optimizer step.

| name | class | file |
| --- | --- | --- |
| 32-true | Precision | `base.py` (the base every mode extends; the loss scaler's bookkeeping) |
| bf16-mixed, 16-mixed | BFloat16Mixed, Float16Mixed | `mixed.py` (autocast; 16-mixed: one GradScaler) |
| bf16-true, 16-true, 64-true | BFloat16True, Float16True, Float64True | `true.py` |
| (under DeepSpeed) | EnginePrecision | `engine.py` |

PRECISIONS maps each name to its class; a new mode is one class and one entry here (or
`register_precision(name, cls)` from outside core).
"""
import torch

from core.errors import CoreTypeError, CoreValueError
from core.precision.base import Precision, cast_floats  # noqa: F401
from core.precision.mixed import BFloat16Mixed, Float16Mixed
from core.precision.true import BFloat16True, Float16True, Float64True

PRECISIONS = {mode.name: mode for mode in (Precision, BFloat16Mixed, Float16Mixed, BFloat16True, Float16True,
                                           Float64True)}
ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's older names


def register_precision(name: str, mode: type) -> None:
    """Make `Fabric(precision=name)` build `mode(device)`, a subclass of Precision."""
    if not (isinstance(mode, type) and issubclass(mode, Precision)):
        raise CoreTypeError(f"A precision mode is a subclass of core.precision.Precision, got {mode!r}.")
    PRECISIONS[name] = mode


def make_precision(name, device: torch.device) -> Precision:
    """The mode named `name` (a name in PRECISIONS, an alias in ALIASES, or the int 16, 32 or 64)."""
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)
    name = ALIASES.get(name, name) if isinstance(name, str) else name
    if not isinstance(name, str) or name not in PRECISIONS:
        raise CoreValueError(f"Unknown precision {name!r}. Choose one of: {', '.join(PRECISIONS)} (or the aliases "
                             f"{', '.join(ALIASES)}, also as ints).")
    mode = PRECISIONS[name](device)
    mode.name = name  # the name it was registered under
    return mode
