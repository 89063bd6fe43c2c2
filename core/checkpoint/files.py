"""Checkpoint files on disk: one atomic write, one safe read (refusing with core.errors.CheckpointError), and the
one-file layout (save_file; the user's keys at the top, read back by load_checkpoint as the logical checkpoint).

A file is written to a temporary name beside the target, flushed to disk and renamed over it; a directory
(sharded, DeepSpeed) is written to a temporary directory and renamed into place, the previous one moved aside
to `.NAME.old` first. Files are read with `weights_only=True`: a file that would need arbitrary pickled objects
is refused, and nothing in it is executed.
"""
import contextvars
import os
import pickle
import shutil
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from core.checkpoint import integrity, space
from core.checkpoint.names import indexed_optimizer_state, is_optimizer_entry, named_optimizer_state
from core.errors import CheckpointError, CoreValueError

STATE = integrity.STATE  # in a sharded or DeepSpeed checkpoint directory: everything that is not a tensor
CREATED = ".created-by-rank-0"  # in a checkpoint directory being written: that every rank sees rank 0's folder

FORMAT = "core-checkpoint"
VERSION = 2  # state.pt beside shards: {"format", "version", "state"}; optimizers by name (1: by index, still read)
MARKER = "_core_checkpoint"  # the one file's own entry beside the user's keys
FILE_VERSION = 3  # the one file: the user's keys at the top (2 and 1 were state.pt's layout, still read)


_weights_only = contextvars.ContextVar("weights_only", default=True)


@contextmanager
def trusted(allow: bool = True):
    """Inside, with `allow`, checkpoint files are read with weights_only=False: arbitrary pickled objects are
    rebuilt, which runs code from the file. Only for files the user says they trust (Fabric.load's
    weights_only=False)."""
    token = _weights_only.set(not allow)
    try:
        yield
    finally:
        _weights_only.reset(token)


class NoSpace(CheckpointError):
    """A save that failed for lack of space; its message is the one line that says so (space.message)."""


def atomic_write(path, write, mode: str = "wb", needed: int | None = None) -> None:
    """`write(f)` into a temporary file beside `path`, flushed to disk, then renamed over `path`: a reader (or a
    later run) sees the old file or the new one, never a partial one, also after a crash mid-write. A directory
    at `path` (a sharded or DeepSpeed checkpoint of the run's earlier strategy) is moved aside first. A write that
    fails for lack of space is a NoSpace error (`needed`: the bytes it would write, for its message)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    recorder = None
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            recorder = space.Recorder(f)
            write(recorder)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir():
            replace_directory(tmp, path, 0, lambda: None)
        else:
            os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if space.lack_of_space(error) or space.lack_of_space(getattr(recorder, "error", None)):
            raise NoSpace(space.message(path, needed)) from error
        raise
    fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clear_stale_temporaries(path: Path) -> None:
    """Delete the temporary files (`.NAME.tmp-PID`) that writes of `path` killed mid-way left, those whose process
    is gone (a live one may be writing: a run sharing the directory, refused by the run's claim)."""
    for tmp in Path(path).parent.glob(f".{Path(path).name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                tmp.unlink(missing_ok=True)
            except PermissionError:  # another user's live process
                pass


def atomic_save(obj, path) -> None:
    """`torch.save(obj)` to `path` through atomic_write."""
    atomic_write(path, lambda f: torch.save(obj, f), needed=space.tensor_bytes(obj))


def staging(path: Path) -> Path:
    """The temporary directory a checkpoint directory is written to before replace_directory moves it to `path`."""
    return path.with_name(f".{path.name}.tmp")


def save_checkpoint(state: dict, path, with_manifest: bool = False) -> None:
    """`state` in core's wrapper; `with_manifest`: the file is a directory checkpoint's state.pt, and the save
    writes the directory's manifest.json (integrity.py), which a load then requires."""
    promise = {integrity.PROMISE: integrity.MANIFEST} if with_manifest else {}
    atomic_save({"format": FORMAT, "version": VERSION, "state": state, **promise}, path)


def clear_directory(tmp: Path, rank: int, barrier) -> None:
    """Make `tmp` empty (rank 0: removing what a killed save left there) before every rank writes its shard into
    it, and make sure every rank sees it: on disks local to each node, a checkpoint would lack the other nodes'
    shards, so a rank that does not see rank 0's folder stops before anything is written."""
    marker = tmp / CREATED
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
    `.NAME.old` and removed after the second rename; `recover` mends what a kill at any point between left."""
    barrier()
    if rank == 0:
        if tmp.is_dir():  # (atomic_save also moves a file here over an earlier strategy's directory)
            (tmp / CREATED).unlink(missing_ok=True)  # clear_directory's
            if not (tmp / integrity.MANIFEST).exists():  # (sharded.save writes it where a full disk is agreed on)
                integrity.write_manifest(tmp)  # every rank has written its files
        recover(path)  # an earlier save killed in its renames or its cleanup
        old = aside(path)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        remove(old)
    barrier()


def stop_together_cleaned(path: Path, tmp: Path, rank: int, stop_together, problem: str | None) -> None:
    """After every rank wrote its part of a directory checkpoint into `tmp`: `stop_together(problem)` (every rank
    raises NoSpace where any rank found no space), the partial directory removed, and the line said (by rank 0)
    with the space free now and the size of the previous checkpoint, which stays whole."""
    try:
        stop_together(problem)
    except NoSpace:
        if rank == 0:
            remove(tmp)
        previous = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else None
        error = NoSpace(space.message(path, previous))
        error.every_rank = True
        raise error from None


def aside(path: Path) -> Path:
    """Where replace_directory keeps the checkpoint it replaces until the new one is in place."""
    return path.with_name(f".{path.name}.old")


def remove(path: Path) -> None:
    """Delete a file or a directory tree if it is there (several ranks may remove the same one at once)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def recover(path) -> None:
    """Mend what a replace_directory killed at any point left: with `path` missing, put the checkpoint at
    `.NAME.old` back (killed between the two renames; every rank may call this, the first rename wins); with
    `path` whole, delete `.NAME.old` (killed while removing it), which would otherwise stop the next save. Also
    delete the temporary files of one-file writes killed mid-way."""
    path = Path(path)
    clear_stale_temporaries(path)
    old = aside(path)
    if not old.exists() and not old.is_symlink():
        return
    if path.exists():  # `path` is only ever a finished checkpoint renamed into place
        remove(old)
        return
    try:
        os.rename(old, path)
    except OSError:
        if not path.exists():
            raise


def load_checkpoint(path, raw: bool = False) -> dict:
    """Read a checkpoint written by `save_file` or `save_checkpoint` as the logical checkpoint; every failure is
    a CheckpointError that says why.
    `raw=True` also takes any dict that `torch.save` wrote (a bare state dict, Lightning's Fabric.save)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"No checkpoint file at {path}" + (" (it is a directory)" if path.is_dir() else "") + ".")
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning would only add noise to our error
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location="cpu", weights_only=_weights_only.get())
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
    except MemoryError:
        raise
    except Exception as error:  # torch's unpickler meets garbage in many ways (KeyError, IndexError, ...)
        reason = (str(error).split(". Please file an issue")[0].splitlines() or [""])[0][:200]  # not our advice
        reason = reason if isinstance(error, (RuntimeError, OSError, EOFError)) and reason else \
            f"{type(error).__name__}: {reason}"
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt: {reason}). "
                              f"Resume from an earlier checkpoint.") from error
    if isinstance(data, dict) and isinstance(data.get(MARKER), dict):
        return _from_file(data)
    if raw and isinstance(data, dict) and data.get("format") != FORMAT:
        return data
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} was not written by core's Fabric.save (no {FORMAT!r} marker). Load it "
                              f"with torch.load and copy the tensors into your model yourself.")
    return data["state"]


def save_file(state: dict, path) -> None:
    """The logical checkpoint as one file (see the top of this module)."""
    out, optimizers = {}, {}
    for key, value in state.items():
        if is_optimizer_entry(value):
            names = [list(group["params"]) for group in value["optimizer"]["param_groups"]]
            out[key] = indexed_optimizer_state(value["optimizer"], names)
            optimizers[key] = {"names": names, "scaler": value["scaler"]}
        else:
            out[key] = value
    if MARKER in out:
        raise CoreValueError(f"{MARKER!r} is the name of the checkpoint's own entry; name the state's entry otherwise.")
    atomic_save({**out, MARKER: {"version": FILE_VERSION, "optimizers": optimizers}}, path)


def _from_file(data: dict) -> dict:
    """The logical checkpoint of a file save_file wrote."""
    optimizers = data[MARKER].get("optimizers", {})
    out = {key: value for key, value in data.items() if key != MARKER}
    for key, entry in optimizers.items():
        if key in out:
            out[key] = {"optimizer": named_optimizer_state(out[key], entry["names"]), "scaler": entry["scaler"]}
    return out


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
