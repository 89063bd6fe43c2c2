"""Checkpoints: one logical content whatever the strategy, in one of three formats.

The logical checkpoint: set-up modules as state dicts keyed by parameter name, optimizers keyed by
parameter name too (`named_optimizer_state`), plus the plain values. The formats, and who writes them:

| format | written by | module |
| --- | --- | --- |
| one file: the state's own keys, optimizers as `optimizer.state_dict()`, + MARKER | single, ddp (rank 0) | `files.py` |
| a directory of DCP shards + `state.pt` | fsdp (every rank its shards) | `sharded.py` |
| a directory of DeepSpeed partitions + `state.pt` | deepspeed* (every rank) | `deepspeed.py` |

`read` turns any of them into the logical checkpoint; `collect` and `restore` go between it and a run's
objects. Every format writes and reads through `files.py` (atomic writes, `weights_only` reads).

The one file is what a Fabric user expects of `torch.load(path)`: their own keys at the top, each module a
state dict and each optimizer a state dict that `optimizer.load_state_dict` takes as it is (Lightning's
`Fabric.load` reads it too); under MARKER sit the format's version and, per optimizer, the names of its
parameters (so that it loads under any strategy) and the loss scaler's state (16-mixed has one for every
optimizer: each entry holds it, and loading any restores it). Files of version 2 (everything under
"state") are still read.
"""
from pathlib import Path

import torch

from core.checkpoint.files import (FORMAT, MARKER, STATE, VERSION, CheckpointError, atomic_save,  # noqa: F401
                                   clear_directory, indexed_optimizer_state, is_optimizer_entry, load_checkpoint,
                                   named_optimizer_state, recover, replace_directory, save_checkpoint, save_file, staging,
                                   trusted)
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
    (with the loss scaler's state beside each optimizer), other modules and optimizers as their state dicts, the rest as is.
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


def apply_filter(collected: dict, filter: dict) -> dict:
    """Fabric.save's `filter` ({key: fn(name, value) -> keep}), as Lightning applies it: to the entries of each
    filtered key's state dict (an optimizer's: to its state dict's own entries)."""
    if not isinstance(filter, dict):
        raise TypeError(f"filter must be a dict of {{state key: callable}}, got {filter!r}.")
    unknown = set(filter) - set(collected)
    if unknown:
        raise ValueError(f"The filter keys {sorted(unknown)} are not keys of the state ({sorted(collected)}).")
    out = dict(collected)
    for key, keep in filter.items():
        if not callable(keep):
            raise TypeError(f"filter[{key!r}] must be a callable (name, value) -> bool, got {keep!r}.")
        value = collected[key]
        if is_optimizer_entry(value):
            out[key] = {**value, "optimizer": {k: v for k, v in value["optimizer"].items() if keep(k, v)}}
        elif isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if keep(k, v)}
    return out


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
            precision.load_state_dict(value.optimizer, entry["scaler"])
        elif isinstance(value, torch.nn.Module):
            check_state_dict(value, saved[key], key, strict)
            value.load_state_dict(saved[key], strict=strict)
        elif hasattr(value, "load_state_dict"):
            value.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    return {key: value for key, value in saved.items() if key not in state}
