"""A save that fails for lack of space (ENOSPC, EDQUOT), told apart from other failures and said in one line: torch's
zip writer turns the OSError of a full disk into `RuntimeError: ... unexpected pos` (keeping the OSError only where
the file it writes to is ours: `Recorder`), and DCP wraps each rank's failure in a CheckpointException, so the cause
is looked for where each of them keeps it."""
import errno
import os
import shutil
from pathlib import Path

import torch

SPACE = (errno.ENOSPC, errno.EDQUOT)


class Recorder:
    """The file a write goes to (a `write` and a `flush`), remembering the OSError its write raised."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self):
        return self.f.flush()


def lack_of_space(error: BaseException | None) -> bool:
    """Whether `error`, or what it wraps (its cause and context, a DCP CheckpointException's failures), is an
    OSError for lack of space."""
    seen, stack = set(), [error]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in SPACE:
            return True
        # torch's zip writer met a short write (the OSError itself is lost inside it): on a local file, a full disk
        if isinstance(error, RuntimeError) and "unexpected pos" in str(error) and "inline_container" in str(error):
            return True
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [error.__cause__, error.__context__]
    return False


def message(path, needed: int | None) -> str:
    """The one line of a save of `path` that found no space; `needed`: bytes it would write, where known."""
    path = Path(path)
    free = shutil.disk_usage(path.parent if path.parent.exists() else ".").free
    need = f", about {needed / 2**20:.1f} MB needed" if needed else ""
    return (f"No space left to save the checkpoint {path}: {free / 2**20:.1f} MB free on its filesystem{need} "
            f"({os.strerror(errno.ENOSPC).lower()}). The previous checkpoint is whole and nothing of this one is "
            f"left: free space there, or move the run directory, then resume.")


def tensor_bytes(obj) -> int:
    """The bytes of the tensors inside nested dicts, lists and tuples (what a save of `obj` writes, about)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    return 0
