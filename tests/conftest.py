"""Shared test set-up: one thread per process, a private classifier cache, helpers to run the scripts."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.resume import resolve_run

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SUITE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


# torchrun on 2 local processes; --standalone takes a free rendezvous port instead of the fixed 29500, which
# another test running at the same time (pytest -n 2) may hold
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run(args, timeout=240, check=True, env=None, **kwargs):
    """Run `python args...` from the repository root; return the CompletedProcess."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def resolved(config_class, **fields):
    """`config_class(**fields)` as the command line gives it with these flags typed, after the run-directory rule
    (a resume takes the flags not typed from the run's config.json)."""
    config = config_class(**fields)
    config.given = set(fields)
    resolve_run(config)
    return config
