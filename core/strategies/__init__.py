"""Strategies: how a module is wrapped, how gradients are synchronised, how state is saved; one class per file.

| name | class | file |
| --- | --- | --- |
| single | SingleDevice | `single.py` (the base: one process, one device) |
| ddp | DDP | `ddp.py` (the process group and the collectives) |
| fsdp | FSDP | `fsdp.py` (FSDP2, imported when chosen) |
| deepspeed, deepspeed_stage_* | DeepSpeed | `deepspeed.py` (imported when chosen) |

STRATEGIES maps each name to its class and the options it is made with; a new strategy is one file and one
entry there, or `register_strategy(name, cls, **options)` from outside core. Lightning's other names
(ddp_spawn, ddp_fork, ddp_notebook, ddp_find_unused_parameters_true, dp) are the drop-in's: `core/compat/`.
"""
import importlib
import inspect

import torch

from core.errors import CoreTypeError, CoreValueError
from core.strategies.ddp import DDP
from core.strategies.single import SingleDevice

# name -> (class or "module:Class", options it is made with); the module is imported when the name is chosen
STRATEGIES = {
    "single": (SingleDevice, {}),
    "ddp": (DDP, {}),
    "fsdp": ("core.strategies.fsdp:FSDP", {}),
    "deepspeed": ("core.strategies.deepspeed:DeepSpeed", {"stage": None}),  # the stage from the config, else 2
    "deepspeed_stage_1": ("core.strategies.deepspeed:DeepSpeed", {"stage": 1}),
    "deepspeed_stage_2": ("core.strategies.deepspeed:DeepSpeed", {"stage": 2}),
    "deepspeed_stage_3": ("core.strategies.deepspeed:DeepSpeed", {"stage": 3}),
    "deepspeed_stage_2_offload": ("core.strategies.deepspeed:DeepSpeed", {"stage": 2, "offload": True}),
    "deepspeed_stage_3_offload": ("core.strategies.deepspeed:DeepSpeed", {"stage": 3, "offload": True}),
}


# what a script may say it needs of every strategy (Fabric(needs=...)), so that a strategy that cannot give it
# refuses before the run starts, with the reason, and one that can prepares for it
NEEDS = {
    "second_backward": "a backward through a gradient of a set-up model (fabric.grad with create_graph: R1, WGAN-GP)",
    "weights_outside_forward": "a set-up model's parameters read as whole tensors outside its forward (MAML's "
                               "functional forward over its weights)",
}


def register_strategy(name: str, strategy, **options) -> None:
    """Make `Fabric(strategy=name)` build `strategy(device, precision, **options, **user_options)`;
    `strategy` is a subclass of SingleDevice, or "module:Class" to import when the name is chosen."""
    if not (isinstance(strategy, str) or isinstance(strategy, type) and issubclass(strategy, SingleDevice)):
        raise CoreTypeError(f"A strategy is a subclass of core.strategies.SingleDevice (or 'module:Class'), "
                            f"got {strategy!r}.")
    if name == "auto":
        raise CoreValueError("'auto' is not a strategy's name: it picks single or ddp by the number of processes.")
    STRATEGIES[name] = (strategy, options)


def strategy_class(name: str, strategies=STRATEGIES):
    """(the class `strategies[name]` names, imported if it is a path; the options the name fixes)."""
    cls, options = strategies[name]
    if isinstance(cls, str):
        module, _, class_name = cls.partition(":")
        cls = getattr(importlib.import_module(module), class_name)
    return cls, options


def refusal(name: str, precision: str, needs, user_options: dict | None = None, strategies=STRATEGIES) -> str | None:
    """Why strategy `name` cannot give a script what it `needs` (None where it can)."""
    unknown = sorted(set(needs) - set(NEEDS))
    if unknown:
        raise CoreValueError(f"Unknown needs {unknown}; a script may say it needs: {', '.join(NEEDS)}.")
    if not needs:
        return None
    cls, options = strategy_class(name, strategies)
    return cls.refusal(set(needs), precision, {**options, **(user_options or {})})


def make_strategy(name: str, device: torch.device, precision, user_options: dict, strategies=STRATEGIES,
                  needs=()):
    """The strategy `strategies[name]` names, made for `device` and `precision` with the user's options, for a
    script that needs `needs` (refused here, with the reason, where the strategy cannot give it)."""
    reason = refusal(name, precision.name, needs, user_options, strategies)
    if reason:
        raise CoreValueError(f"strategy={name!r} cannot give this script {', '.join(sorted(needs))}: {reason}.")
    cls, options = strategy_class(name, strategies)
    fixed = sorted(set(options) & set(user_options))
    if fixed:
        raise CoreValueError(f"strategy={name!r} sets {fixed} itself; drop them, or choose a strategy whose name does "
                             f"not fix them.")
    parameters = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        takes = sorted(set(parameters) - {"self", "device", "precision"} - set(options))
        unknown = sorted(set(user_options) - set(takes))
        if unknown:
            raise CoreTypeError(f"Fabric() got {unknown}, which strategy={name!r} does not take. Its options: "
                                f"{', '.join(takes) or 'none'}.")
    strategy = cls.__new__(cls)
    strategy.name = name  # its registry name, for its messages from __init__ on
    strategy.needs = frozenset(needs)  # before __init__, which may build its config from them
    strategy.__init__(device, precision, **options, **user_options)
    return strategy


def check_installed(name: str, device_type: str) -> None:
    """A strategy that needs an optional package says so in one line when it is missing, before any process
    is started (DeepSpeed; imported here on `device_type`'s accelerator)."""
    if name.startswith("deepspeed"):
        from core.strategies.deepspeed import import_deepspeed
        import_deepspeed(name, device_type)
