"""Checkpoints: one logical content whatever the strategy, in one of three formats.

The logical checkpoint: set-up modules as state dicts keyed by parameter name, optimizers keyed by
parameter name too (`named_optimizer_state`), plus the plain values. The formats, and who writes them:

| format | written by | module |
| --- | --- | --- |
| one file: the state's own keys, optimizers as `optimizer.state_dict()`, + MARKER | single, ddp (rank 0) | `files.py` |
| a directory of DCP shards + `state.pt` | fsdp (every rank its shards) | `sharded.py` |
| a directory of DeepSpeed partitions + `state.pt` | deepspeed* (every rank) | `deepspeed.py` |

`read` turns any of them into the logical checkpoint; `core/state.py` goes between it and a run's set-up
objects (formats only know state dicts). Every format writes and reads through `files.py` (atomic writes, `weights_only` reads).

The one file is what a Fabric user expects of `torch.load(path)`: their own keys at the top, each module a
state dict and each optimizer a state dict that `optimizer.load_state_dict` takes as it is (Lightning's
`Fabric.load` reads it too); under MARKER sit the format's version and, per optimizer, the names of its
parameters (so that it loads under any strategy) and the loss scaler's state (16-mixed has one for every
optimizer: each entry holds it, and loading any restores it). Files of version 2 (everything under
"state") are still read.
"""
from pathlib import Path

import torch

from core.checkpoint.files import (FORMAT, MARKER, STATE, VERSION, CheckpointError, NoSpace, atomic_save,  # noqa: F401
                                   clear_directory, load_checkpoint, recover, replace_directory, save_checkpoint,
                                   save_file, staging, stop_together_cleaned, trusted)
from core.checkpoint.names import indexed_optimizer_state, is_optimizer_entry, named_optimizer_state  # noqa: F401



class InEngine:
    """The entry a strategy's `module_state` or `optimizer_state` gives for state its engine keeps and writes itself
    (DeepSpeed's partitions): `wrapped`, the set-up module whose engine holds it, for its `save_checkpoint`."""

    def __init__(self, wrapped):
        self.wrapped = wrapped


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
