"""Checkpoint files on disk: one atomic write, one safe read, the error they raise.

A file is written to a temporary name beside the target, flushed to disk and renamed over it; a directory
(sharded, DeepSpeed) is written to a temporary directory and renamed into place, the previous one moved aside
to `.NAME.old` first. Files are read with `weights_only=True`: a file that would need arbitrary pickled objects
is refused, and nothing in it is executed.
"""
import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

STATE = "state.pt"  # in a sharded or DeepSpeed checkpoint directory: everything that is not a tensor

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
    """Make `tmp` empty (rank 0: removing what a killed save left there) before every rank writes its shard into
    it, and make sure every rank sees it: on disks local to each node, a checkpoint would lack the other nodes'
    shards, so a rank that does not see rank 0's folder stops before anything is written."""
    marker = tmp / ".created-by-rank-0"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        marker.touch()
    barrier()
    if not marker.exists():
        raise CheckpointError(f"rank {rank} does not see the folder {tmp} that rank 0 created for this checkpoint: "
                              f"every rank writes its shard into it, so it must be on a filesystem every node sees "
                              f"(a shared run directory, --out); on disks local to each node the checkpoint would "
                              f"lack the other nodes' shards.")


def replace_directory(tmp: Path, path: Path, rank: int, barrier) -> None:
    """Once every rank has written `tmp`: move it to `path` (rank 0). `path` is first moved aside to
    `.NAME.old`, which `--resume` finds if the process dies between the two renames."""
    barrier()
    if rank == 0:
        (tmp / ".created-by-rank-0").unlink(missing_ok=True)  # clear_directory's
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
                f"{detail[:200]}") from error
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
