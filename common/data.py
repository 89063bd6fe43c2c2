"""Data helpers both variants share: one download at a time into a data root, and one wording for a download
that failed on the network."""
import fcntl
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path


@contextmanager
def _exclusive(root, timeout: float):
    """Hold an exclusive lock on `root/.download.lock` (waiting at most `timeout` seconds for it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(root / ".download.lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been downloading into {root} for over {timeout:.0f} s "
                                       f"(it holds {root / '.download.lock'}); wait for it, or put the files there "
                                       f"and run without --download") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download_once(root, download: bool, timeout: float = float(os.environ.get("SUITE_DOWNLOAD_TIMEOUT", 3600))):
    """Around a torchvision dataset built with `download=True`: the processes of a run (and any other run on
    this machine) that download into the same root take turns, so the first fetches the files and the
    others find them in place instead of writing the same files at once."""
    return _exclusive(root, timeout) if download else nullcontext()


class DownloadFailed(ValueError):
    """--download could not fetch the dataset (no network, a server down); the message says what to do."""


def download_failure(name: str, root, expected: str, error: Exception) -> DownloadFailed | None:
    """The one-line error for a download that failed on the network, or None for any other failure.
    torchvision raises urllib's URLError (an OSError) from its download, or, for MNIST after trying every
    mirror, a RuntimeError whose last line is the URLError; Google Drive files (CelebA) need gdown."""
    lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    network = isinstance(error, OSError) and not isinstance(error, FileNotFoundError)
    if not (network or lines[0].startswith("Error downloading") or "gdown" in lines[0]):
        return None
    return DownloadFailed(f"could not download {name!r} into {root} ({lines[-1].strip()}); "
                          f"put the files there yourself ({expected}; docs/datasets.md says where to get "
                          f"them) and run without --download")
