"""The checks behind Fabric's error messages: each says what was wrong and what to do instead."""
import inspect
import os

import torch
from torch import nn

from core import launcher
from core.errors import CoreRuntimeError, CoreTypeError, CoreValueError
from core.strategies import STRATEGIES, check_installed
from core.optimizers import FabricOptimizer
from core.wrappers import FabricModule

ACCELERATORS = ("auto", "cpu", "cuda", "gpu")


def device_kind(accelerator: str) -> str:
    """'cuda' or 'cpu' for an accelerator name ('auto': cuda when torch sees a GPU)."""
    return "cuda" if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()) \
        else "cpu"


def check_devices(devices, kind: str, env: dict | None) -> int:
    available = torch.cuda.device_count() if kind == "cuda" else (os.cpu_count() or 1)
    if devices == "auto":
        return env["local_world_size"] if env else (available if kind == "cuda" else 1)
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise CoreValueError(f"devices must be a whole number >= 1 or 'auto', got {devices!r}.")
    if devices > available:
        what = "CUDA devices" if kind == "cuda" else "CPU cores (one process per core)"
        raise CoreValueError(f"devices={devices} but this machine has {available} {what}. Use devices<={available}.")
    if env and env["local_world_size"] != devices:
        raise CoreValueError(f"The launcher started {env['local_world_size']} processes per node but devices="
                             f"{devices}. Pass devices={env['local_world_size']} (or 'auto').")
    return devices


def check_module(module, set_up, strategy) -> None:
    """A set-up module is refused; the same raw module again only where the strategy changes it in place."""
    if isinstance(module, FabricModule):
        raise CoreValueError("A model should be passed only once to the `setup` method: this one is already "
                             "set up. Pass the original module, or keep using the set-up one.")
    if not isinstance(module, nn.Module):
        raise CoreTypeError(f"setup takes an nn.Module first, got {type(module).__name__}.")
    if module in set_up and strategy.changes_module:
        raise CoreValueError(f"This {type(module).__name__} was set up already, and strategy={strategy.name!r} changed "
                             f"it in place (its parameters are now sharded or held by an engine), so it cannot be set "
                             f"up again; use the module setup returned.")


def check_optimizers(optimizers, set_up, strategy) -> None:
    for opt in optimizers:
        if isinstance(opt, FabricOptimizer):
            raise CoreValueError("An optimizer should be passed only once to the `setup` method.")
        if not isinstance(opt, torch.optim.Optimizer):
            raise CoreTypeError(f"Expected torch.optim.Optimizer objects, got {type(opt).__name__}.")
        if opt in set_up and strategy.changes_module:
            raise CoreValueError(
                f"This {type(opt).__name__} was set up already, and strategy={strategy.name!r} changed "
                f"it in place; use the optimizer setup returned.")

def check_ownership(module: nn.Module, optimizers) -> None:
    own = {id(p) for p in module.parameters()}
    for i, opt in enumerate(optimizers):
        foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise CoreValueError(f"Optimizer {i} ({type(opt).__name__}) has {foreign} parameter(s) that do not "
                                 f"belong to the {type(module).__name__} it is set up with (a checkpoint names an "
                                 f"optimizer's state by its module's parameter names, and under ddp only the module's "
                                 f"wrapper synchronises gradients). Set each optimizer up with the module whose "
                                 f"parameters it updates; group two models that share one under one nn.Module; "
                                 f"register a free nn.Parameter on the model before setup "
                                 f"(`model.log_alpha = nn.Parameter(...)`).")


def check_set_up_modules(modules, method: str) -> None:
    for module in modules:
        if not isinstance(module, FabricModule):
            raise CoreTypeError(f"{method} takes modules returned by setup, got {type(module).__name__}.")


def owner_module(optimizer, modules: list) -> FabricModule:
    """The set-up module (of `modules`) whose parameters `optimizer` updates."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for wrapped in modules:
        if params & {id(p) for p in wrapped.parameters()}:
            return wrapped
    raise CoreValueError(
        f"{type(optimizer).__name__} updates no parameter of any module returned by setup_module (under fsdp, "
        f"an optimizer built before setup_module holds the unsharded parameters), and core needs that module: "
        f"checkpoints name the optimizer's state by its parameter names. Create the optimizer after "
        f"setup_module, from the returned module's parameters: `model = fabric.setup_module(model); optimizer "
        f"= Adam(model.parameters())`, or set both up together: `fabric.setup(model, optimizer)`. A free "
        f"nn.Parameter belongs on a model too: `model.log_alpha = nn.Parameter(...)` before setup.")


def check_launch_function(fn, args: tuple, kwargs: dict) -> None:
    """fabric.launch(fn, *args, **kwargs) runs fn(fabric, *args, **kwargs) in every process: check that fn takes
    those arguments before any process starts."""
    if not callable(fn):
        raise CoreTypeError(f"fabric.launch(fn) takes a function to run in every process, got {fn!r}; call "
                            f"fabric.launch() without arguments to start the processes and go on in this script.")
    try:
        inspect.signature(fn).bind(object(), *args, **kwargs)
    except TypeError:
        name = getattr(fn, "__name__", "fn")
        raise CoreTypeError(
            f"fabric.launch({name}, ...) calls {name}(fabric, *args, **kwargs) with the Fabric first and "
            f"then the arguments launch was given ({len(args)} positional, keywords {sorted(kwargs)}), "
            f"which its signature {inspect.signature(fn)} does not take: define it as "
            f"`def {name}(fabric, ...)`.") from None
    except ValueError:  # a builtin without a readable signature: let the call say
        pass


def reduce_op(op):
    """A reduce_op argument as a torch ReduceOp, or "mean"."""
    import torch.distributed as dist
    if isinstance(op, dist.ReduceOp) or type(op).__name__ == "RedOpType":
        return op
    names = {"mean": "mean", "avg": "mean", "sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
    if not isinstance(op, str) or op.lower() not in names:
        raise CoreValueError(
            f"reduce_op must be one of {', '.join(names)} or a torch.distributed.ReduceOp, got {op!r}.")
    name = names[op.lower()]
    return "mean" if name == "mean" else getattr(dist.ReduceOp, name)


def unknown_strategy(name, strategies) -> str:
    message = f"Unknown strategy {name!r}. Choose one of: {', '.join(['auto', *strategies])}."
    if name in ("ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true", "dp"):
        message += " Lightning's other names come with its drop-in: `from core.compat import Fabric`."
    return message


def check_not_drop_in(strategy_options: dict) -> None:
    """core.Fabric refuses the arguments only the Lightning drop-in takes, naming it."""
    drop_in = [name for name in ("plugins", "callbacks", "loggers") if name in strategy_options]
    if drop_in:
        raise CoreTypeError(f"Fabric({drop_in[0]}=...) is Lightning Fabric's, which core offers as a layer of its "
                            f"own: `from core.compat import Fabric` takes it.")


def module_options(options: dict, strategy) -> dict:
    """The per-module options of setup (`ddp={...}`, `fsdp={...}`) for the strategy that runs."""
    unknown = set(options) - {"ddp", "fsdp"}
    if unknown:
        raise CoreTypeError(
            f"Unknown setup arguments {sorted(unknown)}: per-module options are passed by strategy, "
            f"as ddp={{...}} or fsdp={{...}}.")
    return dict(options.get(strategy.options_key, {}))


def resolve_arguments(accelerator, strategy, devices, num_nodes, strategies=STRATEGIES):
    """Fabric's arguments checked, with `auto` resolved: (accelerator, strategy, devices, num_nodes, the
    launcher's environment). `strategies`: the table of the names the Fabric takes."""
    if accelerator not in ACCELERATORS:
        raise CoreValueError(f"Unknown accelerator {accelerator!r}. Choose one of: {', '.join(ACCELERATORS)}.")
    if strategy != "auto" and strategy not in strategies:
        raise CoreValueError(unknown_strategy(strategy, strategies))
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise CoreRuntimeError(f"accelerator={accelerator!r} but no CUDA device is visible to torch. "
                               f"Use accelerator='cpu' (or 'auto').")
    kind = device_kind(accelerator)
    check_installed(strategy, kind)
    env = launcher.cluster_environment()
    devices = check_devices(devices, kind, env)
    if isinstance(num_nodes, str) and num_nodes.isdigit():
        num_nodes = int(num_nodes)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise CoreValueError(f"num_nodes must be a whole number >= 1, got {num_nodes!r}.")
    if strategy == "auto":
        strategy = "ddp" if devices * num_nodes > 1 or (env and env["world_size"] > 1) else "single"
    if strategy == "single" and devices * num_nodes > 1:
        raise CoreValueError(f"strategy='single' runs one process, but devices={devices} and num_nodes={num_nodes}. "
                             f"Use strategy='ddp' (or fsdp, deepspeed) for several.")
    return accelerator, strategy, devices, num_nodes, env
