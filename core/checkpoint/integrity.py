"""Checksums of what a save writes, checked before a load uses it: a changed byte, a truncated or missing file or
an extra one is found, never loaded silently (torch's zip reader does not check the CRCs a zip holds, and DCP
shards carry none).

- One file (torch.save's zip): each member carries the CRC-32 the zip format records; `zipfile.testzip` reads
  every member and compares (standard library, the zip's own checksums: nothing to add to the file).
- A directory (sharded, DeepSpeed): `manifest.json`, written by rank 0 once every rank has written its files,
  before the directory is renamed into place, lists each file's size and XXH3-64 hash (the `xxhash` package).
  Each rank hashes the files it wrote (`write_rank_hashes`, while they are in its page cache); rank 0 merges
  those and hashes only the rest (state.pt, DCP's .metadata), so no rank reads the whole checkpoint.
  A fast non-cryptographic hash: it guards against bit rot and bad copies, not against an attacker (the files
  are read with weights_only=True for that). XXH3 runs at the speed of reading the file from memory here; zlib's
  CRC-32 took 2.5x as long (0.27 s against 0.11 s for a 576 MB shard), a third of the load it guards.

A directory core writes says in its `state.pt` that it has a manifest (`"checksums": "manifest.json"` beside
the state), so a deleted manifest is refused like a changed byte. A checkpoint with neither (a directory written by
core before it recorded checksums, or a foreign non-zip file) still loads, with a note.
"""
import json
import os
import zipfile
import zlib
from pathlib import Path

import torch
import xxhash

MANIFEST = "manifest.json"
STATE = "state.pt"  # a directory checkpoint's file of everything that is not a tensor (files.STATE)
PROMISE = "checksums"  # the key of state.pt's wrapper that names the manifest the save wrote
RANK_HASHES = ".hashes-{rank}.json"  # a rank's hashes of the files it wrote, until write_manifest merges them
CHUNK = 4 << 20  # bytes read at a time, into one buffer (a new one per read costs more than the hash, where large
# allocations are mappings of their own)


def digest(path: Path) -> str:
    """The file's XXH3-64 hash, hex."""
    hasher, buffer = xxhash.xxh3_64(), bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            hasher.update(view[:read])
    return hasher.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def _entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "xxh3_64": digest(path)}


def write_rank_hashes(directory: Path, rank: int, written) -> None:
    """This rank's entries for the files it wrote (`written`: paths under `directory`), for write_manifest."""
    directory = Path(directory)
    files = {Path(p) for p in written if Path(p).is_file()}  # (one the writer did not leave: rank 0 lists what is)
    entries = {str(path.relative_to(directory)): _entry(path) for path in files}
    (directory / RANK_HASHES.format(rank=rank)).write_text(json.dumps(entries))


def write_manifest(directory: Path) -> None:
    """List every file under `directory` with its size and hash in `directory/manifest.json`, flushed to disk:
    the ranks' own hashes (write_rank_hashes) where they wrote them, the rest hashed here."""
    directory = Path(directory)
    hashed = {}
    for part in sorted(directory.glob(RANK_HASHES.format(rank="*"))):
        hashed.update(json.loads(part.read_text()))
        part.unlink()
    entries = {name: hashed.get(name) or _entry(directory / name) for name in _files(directory)}
    with open(directory / MANIFEST, "w") as f:
        json.dump({"format": "core-manifest", "version": 1, "hash": "xxh3_64", "files": entries}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())


def problems(path, rank: int = 0, world_size: int = 1) -> tuple[list[str], str | None]:
    """(what does not match, a note for a checkpoint without checksums) for the checkpoint at `path`. The files'
    hashes are shared out: this process reads every `world_size`-th file from its `rank` on; the names and sizes
    every process checks."""
    path = Path(path)
    if path.is_file():
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                if f.read(4) == b"PK\x03\x04":  # a zip's start, without the record a zip ends with
                    return ["the zip's end is missing (cut short)"], None
            return [], f"{path} is not a zip (torch.save's legacy format, or another tool's): it holds no checksums"
        if rank != 0:
            return [], None
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as error:
            return [f"its zip cannot be read ({error})"], None
        return ([f"its part {bad} does not match the checksum (CRC-32) saved with it"] if bad else []), None
    manifest = path / MANIFEST
    if not manifest.is_file():
        if _promised(path):
            return [f"{MANIFEST}: missing, though its state.pt says the save wrote one"], None
        return [], f"{path} holds no {MANIFEST} (saved before core recorded checksums)"
    try:
        listed = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError, OSError) as error:
        return [f"its {MANIFEST} cannot be read ({error})"], None
    present = _files(path)
    found = [f"{name}: missing" for name in listed if name not in present]
    found += [f"{name}: a file the save did not write" for name in present if name not in listed]
    found += [f"{name}: {listed[name]['bytes']} bytes saved, {(path / name).stat().st_size} now" for name in present
              if name in listed and (path / name).stat().st_size != listed[name]["bytes"]]
    if not found:
        for name in sorted(listed)[rank::world_size]:
            try:
                if digest(path / name) != listed[name]["xxh3_64"]:
                    found.append(f"{name}: does not match the checksum saved with it")
            except OSError as error:  # said by every rank together (a raise on one rank would hang the others)
                found.append(f"{name}: cannot be read ({error.strerror or error})")
    return found, None


def _promised(directory: Path) -> bool:
    """Whether the directory's state.pt says its save wrote a manifest (False where state.pt cannot be read: the
    load then says what is wrong with it)."""
    try:
        wrapper = torch.load(directory / STATE, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return isinstance(wrapper, dict) and wrapper.get(PROMISE) == MANIFEST


def refusal(path, found: list[str]) -> str:
    """The one line a load that found `found` refuses with."""
    shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"The checkpoint {path} changed after it was saved (a flipped bit, a truncated or corrupt copy): "
            f"{shown}. It was not loaded; resume from another checkpoint.")
