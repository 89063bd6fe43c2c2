"""One atomic write for what both variants leave in a run directory (config and summary JSON, the plain
checkpoint, cached files): a temporary file beside the target, flushed to disk, renamed over it. (core has its
own, `core/checkpoint/files.py`: the plain scripts import nothing from core, and core nothing from here.)"""
import os
from pathlib import Path


def atomic_write(path, write, mode: str = "wb") -> None:
    """`write(f)` into a temporary file beside `path`, then renamed over it: readers see the old file or the new
    one, never a partial one, also after a crash mid-write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
