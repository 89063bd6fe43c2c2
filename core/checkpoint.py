"""Checkpoint files: atomic writes, safe reads, and errors that say what does not match.

One logical checkpoint, whatever the strategy: set-up modules as state dicts keyed by parameter name,
optimizers keyed by parameter name too (`named_optimizer_state`), plus the plain values. single and ddp
write it as one `torch.save` file: {"format": FORMAT, "version": VERSION, "state": {...}}, to a temporary
file beside the target, flushed to disk and renamed over it, so a crash mid-write leaves the previous
checkpoint intact. fsdp writes the same content sharded (`core/sharded.py`), deepspeed in its engines'
own partitions (`core/deepspeed.py`); `read` turns any of them into the logical checkpoint. Files are read
with `weights_only=True`: a file that would need arbitrary pickled objects to load is refused, and
nothing in it is executed.
"""
import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

from core.wrappers import FabricModule, FabricOptimizer

FORMAT = "core-checkpoint"
VERSION = 2  # 2: optimizer state keyed by parameter name (1: by index, still read)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, foreign, unsafe, or not matching the run."""


def atomic_save(obj, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir():  # a sharded or DeepSpeed checkpoint of this run's earlier strategy: moved aside first
            replace_directory(tmp, path, 0, lambda: None)
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict, path) -> None:
    atomic_save({"format": FORMAT, "version": VERSION, "state": state}, path)


def clear_directory(tmp: Path, rank: int, barrier) -> None:
    """Remove what a killed save left at `tmp` (rank 0), before every rank writes into it."""
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    barrier()


def replace_directory(tmp: Path, path: Path, rank: int, barrier) -> None:
    """Once every rank has written `tmp`: move it to `path` (rank 0). `path` is first moved aside to
    `.NAME.old`, which `--resume` finds if the process dies between the two renames."""
    barrier()
    if rank == 0:
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    barrier()


def load_checkpoint(path, raw: bool = False) -> dict:
    """Read a checkpoint written by `save_checkpoint`; every failure is a CheckpointError that says why.
    `raw=True` also takes any dict that `torch.save` wrote (a bare state dict, Lightning's Fabric.save)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"No checkpoint file at {path}" + (" (it is a directory)" if path.is_dir() else "") + ".")
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning would only add noise to our error
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        imports = _imports_in(path)
        detail = next((line for line in lines if "GLOBAL" in line), "") or \
            (f"It imports {', '.join(imports[:5])}." if imports else "")
        if detail:
            raise CheckpointError(
                f"{path} holds pickled objects that are not plain tensors and containers, so it was refused "
                f"without running any of it (weights_only loading). Only load files you trust. "
                f"{detail[:200]}") from None
        # torch's text around the cause: the advice to file an issue or rerun unsafely is not for this case
        advice = ("Weights only", "Please file an issue", "Check the documentation", "Re-running")
        detail = next((line for line in lines if not line.startswith(advice)), lines[-1])
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt: {detail[:200]}). "
                              f"Resume from an earlier checkpoint.") from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as error:
        reason = str(error).split(". Please file an issue")[0].splitlines()[0][:200]  # torch's advice is not ours
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt: {reason}). "
                              f"Resume from an earlier checkpoint.") from error
    if raw and isinstance(data, dict) and data.get("format") != FORMAT:
        return data
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by core's Fabric.save (no {FORMAT!r} marker). Load it "
                              f"with torch.load and copy the tensors into your model yourself.")
    return data["state"]


def _imports_in(path: Path) -> list[str]:
    """The module.name references in a pickle (a plain one, or the data.pkl of torch's zip format),
    found by reading its opcodes with pickletools: nothing in it is run."""
    import pickletools

    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
                data = archive.read(name)
        else:
            data = path.read_bytes()
        found, strings = [], []
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                strings.append(arg)
            elif opcode.name == "GLOBAL":
                found.append(arg.replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
        return [name for name in found if not name.startswith(("torch.", "collections.OrderedDict"))]
    except Exception:
        return []


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
        from core import sharded

        if sharded.is_sharded(path):
            return sharded.read_full(path)
        if (path / "state.pt").is_file():
            from core.deepspeed_checkpoint import read_deepspeed

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
        raise CheckpointError(f"The checkpoint {path} has no {missing} (it holds {shown}). Pass strict=False to "
                              f"load what is there; a bare state dict (torch.save(model.state_dict())) loads with "
                              f"fabric.load_raw(path, model).")
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
