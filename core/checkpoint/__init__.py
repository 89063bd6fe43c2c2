"""Checkpoints: one logical content whatever the strategy, in one of three formats.

The logical checkpoint: set-up modules as state dicts keyed by parameter name, optimizers keyed by
parameter name too (`named_optimizer_state`), plus the plain values. The formats, and who writes them:

| format | written by | module |
| --- | --- | --- |
| one file: {"format": FORMAT, "version": VERSION, "state": {...}} | single, ddp (rank 0) | `files.py` |
| a directory of DCP shards + `state.pt` | fsdp (every rank its shards) | `sharded.py` |
| a directory of DeepSpeed partitions + `state.pt` | deepspeed* (every rank) | `deepspeed.py` |

`read` turns any of them into the logical checkpoint; `collect` and `restore` go between it and a run's
objects. Every format writes and reads through `files.py` (atomic writes, `weights_only` reads).
"""
from pathlib import Path

import torch

from core.checkpoint.files import (FORMAT, STATE, VERSION, CheckpointError, atomic_save, clear_directory,  # noqa: F401
                                   load_checkpoint, replace_directory, save_checkpoint)
from core.wrappers import FabricModule, FabricOptimizer


def check_state_dict(module: torch.nn.Module, state: dict, name: str, strict: bool = True) -> None:
    """Raise a CheckpointError listing every missing, unexpected or mis-shaped key."""
    expected = module.state_dict()
    problems = []
    for key, value in state.items():
        if key in expected and hasattr(value, "shape") and tuple(value.shape) != tuple(expected[key].shape):
            problems.append(f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(expected[key].shape)}")
    if strict:
        problems += [f"{key}: missing from the checkpoint" for key in expected if key not in state]
        problems += [f"{key}: not in the model" for key in state if key not in expected]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"The checkpoint's {name!r} does not match the model: {shown}. Was it saved "
                              f"from a model of another shape or configuration?")


def named_optimizer_state(state: dict, groups: list[list[str]]) -> dict:
    """`optimizer.state_dict()` keyed by parameter name instead of position (the layout of
    torch.distributed.checkpoint: state {name: {...}}, param_groups with "params": [names]), so that it loads
    under any strategy. `groups`: the names of the parameters of each of the optimizer's groups, in order."""
    if all(isinstance(i, str) for group in state["param_groups"] for i in group["params"]):
        return state
    saved = [i for group in state["param_groups"] for i in group["params"]]
    names = [name for group in groups for name in group]
    if len(saved) != len(names):
        raise CheckpointError(f"The checkpoint's optimizer state is for {len(saved)} parameters, the optimizer has "
                              f"{len(names)}. Was it saved with another model or optimizer?")
    name_of = dict(zip(saved, names))  # torch numbers the parameters in the order of their groups
    return {"state": {name_of[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def indexed_optimizer_state(state: dict, groups: list[list[str]]) -> dict:
    """The inverse, as torch.optim's load_state_dict takes it: each name becomes the position of that
    parameter in this optimizer (torch pairs saved and current parameters by position within a group)."""
    if not all(isinstance(i, str) for group in state["param_groups"] for i in group["params"]):
        return state
    if len(state["param_groups"]) != len(groups):
        raise CheckpointError(f"The checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this "
                              f"one {len(groups)}. Build the optimizer with the groups of the run that saved it.")
    index = {name: i for i, name in enumerate(name for group in groups for name in group)}
    out_groups = []
    for number, (saved, names) in enumerate(zip(state["param_groups"], groups)):
        if set(saved["params"]) != set(names):
            differ = sorted(set(saved["params"]) ^ set(names))
            raise CheckpointError(f"The checkpoint's optimizer group {number} does not hold the parameters of this "
                                  f"one (differing: {', '.join(differ[:5])}). Was it saved with another model?")
        out_groups.append({**saved, "params": [index[name] for name in names]})
    return {"state": {index[name]: value for name, value in state["state"].items() if name in index},
            "param_groups": out_groups}


def parameter_names(optimizer, module: torch.nn.Module) -> list[list[str]]:
    """The names in `module` of each group's parameters of `optimizer`, in order."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def read(path) -> dict:
    """Any checkpoint core writes, or a dict `torch.save` wrote, as one logical checkpoint: full tensors on
    the CPU, modules as state dicts and optimizers keyed by parameter name. A sharded directory is read
    whole, a DeepSpeed one converted from its partitions."""
    path = Path(path)
    if path.is_dir():
        from core.checkpoint import sharded

        if sharded.is_sharded(path):
            return sharded.read_full(path)
        if (path / STATE).is_file():
            from core.checkpoint.deepspeed import read_deepspeed

            return read_deepspeed(path)
    return load_checkpoint(path, raw=True)


def collect(state: dict, strategy, precision, module_of: dict) -> dict:
    """What `fabric.save` writes for `state`: set-up modules and optimizers as the strategy's state dicts
    (with each optimizer's loss scale), other modules and optimizers as their state dicts, the rest as is.
    `module_of` maps id(wrapped optimizer) to the FabricModule it updates."""
    def state_of(value):
        if isinstance(value, FabricModule):
            return strategy.module_state(value)
        if isinstance(value, FabricOptimizer):
            return {"optimizer": strategy.optimizer_state(value.optimizer, module_of[id(value)]),
                    "scaler": precision.state_dict(value.optimizer)}
        if hasattr(value, "state_dict"):
            return value.state_dict()
        return value
    return {key: state_of(value) for key, value in state.items()}


def restore(saved: dict, state: dict, strategy, precision, module_of: dict, path, strict: bool,
            raw: bool = False) -> dict:
    """Load `saved` into `state`'s objects in place and its plain values into `state`; return what `saved`
    holds beyond `state`. `raw`: `saved` holds bare state dicts (an optimizer's without its loss scale)."""
    missing = [key for key in state if key not in saved]
    if missing and strict:
        held = sorted(map(str, saved))
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise CheckpointError(f"The checkpoint {path} has no {missing} (it holds {shown}): was it saved by another "
                              f"script or workload? In your own code, fabric.load(path, state, strict=False) loads "
                              f"what is there, and fabric.load_raw(path, model) a bare state dict.")
    for key, value in state.items():
        if key not in saved:
            continue
        if isinstance(value, FabricModule):
            strategy.load_module_state(value, saved[key], strict, key, path)
        elif isinstance(value, FabricOptimizer):
            entry = {"optimizer": saved[key], "scaler": None} if raw or "optimizer" not in saved[key] else saved[key]
            module = module_of[id(value)]
            optimizer_state = entry["optimizer"]
            if isinstance(optimizer_state, dict) and "param_groups" in optimizer_state:  # else: with its engine
                optimizer_state = named_optimizer_state(optimizer_state, strategy.parameter_names(value.optimizer,
                                                                                                  module))
            strategy.load_optimizer_state(value.optimizer, module, optimizer_state)
            value.__dict__.update(state=value.optimizer.state, param_groups=value.optimizer.param_groups)
            precision.load_state_dict(value.optimizer, entry["scaler"])
        elif isinstance(value, torch.nn.Module):
            check_state_dict(value, saved[key], key, strict)
            value.load_state_dict(saved[key], strict=strict)
        elif hasattr(value, "load_state_dict"):
            value.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    return {key: value for key, value in saved.items() if key not in state}
