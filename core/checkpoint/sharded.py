"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP), and reading them back safely.

A sharded checkpoint is a directory: DCP's files for the tensors (every rank writes the shards it holds,
in parallel; nothing is gathered on rank 0), and `state.pt`, a core checkpoint file with everything that
is not a tensor (plain values, optimizer hyperparameters, loss scales). Tensors are keyed by parameter
name, so DCP reshards them on load to any number of processes: `load_into` fills a state dict of
DTensors in place (each rank reads only the parts it holds), `read_full` reads every tensor whole (for a
strategy that does not shard).

DCP writes its `.metadata` file with pickle and would read it back with `pickle.load`; `SafeReader`
reads it with an unpickler that builds only DCP's own metadata classes and torch's dtypes and sizes, and
refuses checkpoints with non-tensor (pickled) entries, so loading runs no code from the file.
"""
import contextlib
import dataclasses
import enum
import io
import pickle
import warnings
from pathlib import Path

import torch

from core.checkpoint import files, integrity, space

STATE = files.STATE


_NONE = object()  # "no part here", as distinct from a value None


def _split(value):
    """(tensors, rest): the tensor leaves of nested dicts, and the same dicts without them."""
    if isinstance(value, torch.Tensor):
        return value, _NONE
    if not isinstance(value, dict):
        return _NONE, value
    tensors, rest = {}, {}
    for key, item in value.items():
        t, r = _split(item)
        if t is not _NONE:
            tensors[key] = t
        if r is not _NONE:
            rest[key] = r
    return (tensors or _NONE), (rest if rest or not tensors else _NONE)


def merge(tensors: dict, rest: dict) -> dict:
    """The inverse of `_split`: `rest` with the tensors put back in their places."""
    out = dict(rest)
    for key, item in tensors.items():
        out[key] = merge(item, out.get(key, {})) if isinstance(item, dict) else item
    return out


def split(state: dict) -> tuple[dict, dict]:
    tensors, rest = _split(state)
    return ({} if tensors is _NONE else tensors), ({} if rest is _NONE else rest)


@contextlib.contextmanager
def _alone_is_intended():
    """DCP warns when it runs without a process group; here that is the intent, not a fallback."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_sharded(path) -> bool:
    return (Path(path) / ".metadata").is_file()


def _alone(problem: str | None) -> None:
    """stop_together of one process: a problem stops it."""
    if problem is not None:
        raise files.NoSpace(problem)


def save(path, state: dict, rank: int, barrier, stop_together=_alone, group=None) -> None:
    """Write `state` (every rank passes its own view: DTensors for its shards, full tensors where replicated)
    as a sharded checkpoint directory, atomically: a temporary directory renamed into place. A rank that finds
    no space: `stop_together(its line)` (every rank calls it) stops them all, the temporary directory removed.
    `group`: the process group of DCP's collectives (a background save's), None for the default one."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp = files.staging(path)
    files.clear_directory(tmp, rank, barrier)
    tensors, rest = split(state)
    alone = not torch.distributed.is_initialized()  # one process: no group to coordinate
    problem = None
    try:
        with _alone_is_intended():
            # a tensor every rank holds whole is written once; by rank 0, whose copy a one-process save or the
            # plain scripts would keep (BatchNorm statistics that differ per rank: DCP's default picks any rank)
            dcp.save(tensors, storage_writer=HashingWriter(str(tmp), rank, sync_files=True), no_dist=alone,
                     planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True), process_group=group)
        if rank == 0:  # DCP's save returns once every rank's files are written
            files.save_checkpoint(rest, tmp / STATE, with_manifest=True)
            (tmp / files.CREATED).unlink(missing_ok=True)  # clear_directory's, not part of the checkpoint
            integrity.write_manifest(tmp)
    except BaseException as error:  # (DCP's CheckpointException is one) no space: said together; the rest: as is
        if not space.lack_of_space(error):
            raise
        problem = "no space"
    files.stop_together_cleaned(path, tmp, rank, stop_together, problem)
    files.replace_directory(tmp, path, rank, barrier)


def read_rest(path) -> dict:
    return files.load_checkpoint(Path(path) / STATE)


def load_into(path, held: dict) -> dict:
    """The tensors of `held` (nested dicts as this process holds them: DTensors of its shards, full tensors
    where replicated), filled in place from the checkpoint, for the entries it has; every rank calls it. DCP
    reads each rank's part and reshards to this number of processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    # every rank reads the same metadata, so all of them refuse together, before any waits in a collective
    names = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
    absent = sorted(name for name in names if name and not (Path(path) / name).exists())
    if absent:
        raise files.CheckpointError(
            f"The sharded checkpoint {path} lacks {', '.join(absent)}: every rank writes its own shard files, so "
            f"the run directory must be on a filesystem all nodes share. Copy the missing files in, or resume "
            f"from another checkpoint.")
    saved = {(metadata.planner_data or {}).get(key, (key,))[0] for key in metadata.state_dict_metadata}
    targets = {key: value for key, value in split(held)[0].items() if key in saved}
    try:
        dcp.load(targets, storage_reader=reader)
        return targets
    except CheckpointException as error:  # a BaseException that carries each rank's failure
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(error, "failures", {}).values()]
        raise _reason(path, failures or [error]) from error
    except RuntimeError as error:
        reason = _reason(path, [error])
        if reason is error:
            raise
        raise reason from error


def _reason(path, failures: list[BaseException]) -> BaseException:
    """What a failed DCP load raises: a resource or communication failure (out of memory, a dead peer) as
    itself, with its own class and message; keys or shapes that the model does not have as "does not match";
    anything else (a corrupt or truncated file) as unreadable."""
    for failure in failures:
        if isinstance(failure, (MemoryError, torch.OutOfMemoryError, ConnectionError, TimeoutError)) or \
                isinstance(failure, torch.distributed.DistError) or \
                any(word in str(failure) for word in ("gloo", "NCCL", "Connection closed", "Connection reset")):
            return failure
    text = "\n".join(str(failure) for failure in failures)
    mismatch = [line.strip() for line in text.splitlines() if "Missing key" in line or "Size mismatch" in line]
    if mismatch:
        return files.CheckpointError(f"The sharded checkpoint {path} does not match the model or optimizer: "
                                     f"{'; '.join(dict.fromkeys(mismatch))[:600]}. Was it saved from a model of "
                                     f"another shape, or with another optimizer?")
    return files.CheckpointError(f"The sharded checkpoint {path} could not be read: {text.splitlines()[-1][:300]}")


def read_full(path) -> dict:
    """Every tensor of the checkpoint whole, on the CPU, merged with `state.pt`: the logical checkpoint
    that a strategy without shards loads. Each process reads it by itself (no collectives)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    flat = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    with _alone_is_intended():
        dcp.load(flat, storage_reader=reader, no_dist=True)
    tensors = {}
    for key, value in flat.items():  # DCP flattened nested dicts to dotted keys; its planner data has each path
        *parents, leaf = metadata.planner_data.get(key, (key,)) if metadata.planner_data else (key,)
        node = tensors
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return merge(tensors, read_rest(path))


try:
    from torch.distributed.checkpoint import FileSystemReader as _Reader
    from torch.distributed.checkpoint import FileSystemWriter as _Writer
except ImportError:  # torch built without distributed: nothing sharded to read or write
    _Reader = _Writer = object


class HashingWriter(_Writer):
    """DCP's file writer that hashes this rank's files once it has written them (integrity.write_rank_hashes),
    before DCP's final gather, so that rank 0 finds every rank's hashes when it writes the manifest."""

    def __init__(self, path, rank: int, **options):
        super().__init__(path, **options)
        self.hashing_rank = rank  # (not `rank`: DCP sets that to the rank in its group)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # (DCP's file writer is done when it returns)
        root = Path(str(self.path))
        written = {root / result.storage_data.relative_path for result in future.wait()}
        integrity.write_rank_hashes(root, self.hashing_rank, written)
        return future


class SafeReader(_Reader):
    """DCP's file reader with a metadata unpickler that builds DCP's metadata types and nothing else."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

        file = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ValueError, TypeError) as error:
            raise files.CheckpointError(f"{file} is not a readable sharded checkpoint's metadata ({error}); it "
                                        f"was refused without running any of it. Resume from an earlier "
                                        f"checkpoint.") from error
        pickled = [key for key, entry in metadata.state_dict_metadata.items()
                   if isinstance(entry, BytesStorageMetadata)]
        if pickled:
            raise files.CheckpointError(f"The sharded checkpoint {self.path} holds pickled objects ({pickled[:3]}), "
                                        f"which core never writes; it was refused without reading them.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
            ("torch.serialization", "_get_layout")}  # _get_layout: looks a torch.layout up by name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED:
            found = super().find_class(module, name)
            if dataclasses.is_dataclass(found) or isinstance(found, enum.EnumMeta) or (module, name) in _ALLOWED:
                return found  # records and enums: building one runs nothing of the file's choosing
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_TYPES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which DCP metadata never holds")
