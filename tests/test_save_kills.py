"""A sharded save (fsdp, DeepSpeed) killed at each step of its sequence: the run resumes and saves twice more.

Rank 0's filesystem calls are the steps: a `sitecustomize` on the processes' path (FAULTS below) sees each
`os.replace`/`os.rename` (before and after it) and each removal of a replaced checkpoint (after its first file is
gone), and SIGKILLs the process at the one SUITE_KILL_AT names ("after last.ckpt 2": the second time that rename
has happened): the state a preemption at that instruction leaves on disk, with no handler run. The kill points
cover each state a save passes through; between two of them nothing on disk changes.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from core.checkpoint import read
from tests.conftest import HANG, ROOT, built_once

FAULTS = '''
import os, shutil, signal
from pathlib import Path

KILL_AT = os.environ.get("SUITE_KILL_AT", "")
if KILL_AT and os.environ.get("RANK", "0") == "0":  # rank 0 renames and removes; the other ranks write shards
    seen = {}

    def event(kind, path):
        what = f"{kind} {Path(path).name}"
        seen[what] = seen.get(what, 0) + 1
        if f"{what} {seen[what]}" == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    def step(real):
        def call(src, dst, *args, **kwargs):
            event("before", dst)
            real(src, dst, *args, **kwargs)
            event("after", dst)
        return call

    os.replace, os.rename, real_rmtree = step(os.replace), step(os.rename), shutil.rmtree

    def rmtree(path, *args, **kwargs):
        first = next((p for p in sorted(Path(path).rglob("*")) if p.is_file()), None)
        if path and Path(path).name.endswith(".old") and first is not None:
            first.unlink()
            event("removing", path)
        real_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree
'''

# saves at steps 2, 4, ...: the second save is the first to replace a checkpoint
KILL_POINTS = ["before state.pt 2",  # the shards written, not the rest of the state
               "after state.pt 2",  # the new checkpoint whole in its staging folder
               "after .last.ckpt.old 1",  # the old one moved aside, the new one not yet in place
               "after last.ckpt 2",  # the new one in place, the old one not yet removed
               "removing .last.ckpt.old 1"]  # killed while removing the old one
SMALL = ["-m", "autoencoder.train", "--accelerator", "cpu", "--devices", "2", "--batch-size", "8", "--width", "4",
         "--checkpoint-every", "2", "--log-every", "2", "--max-steps", "8"]


def train(hook, out, strategy, *extra, **env):
    environment = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, *SMALL, "--strategy", strategy, "--out", str(out), *extra], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=600)


def wait_for_exit(out, timeout=HANG):
    deadline = time.monotonic() + timeout
    while subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, f"a process of the killed run in {out} is still running"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def hook(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hook")
    (folder / "sitecustomize.py").write_text(FAULTS)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(hook, tmp_path_factory):
    """The weights of the run no kill stopped, per strategy: built once for the session's workers (the cells of one
    strategy run on both)."""
    def of(strategy):
        def build(folder):
            result = train(hook, folder / "run", strategy)
            assert result.returncode == 0, result.stderr[-3000:]
        folder = built_once(tmp_path_factory, f"save-kills-{strategy}", build)
        return read(folder / "run" / "checkpoints" / "last.ckpt")["model"]
    return of


# every kill point under fsdp; DeepSpeed's partitions at the two that differ by what a strategy has written (its
# files without the rest of the state; its checkpoint moved aside): the renames and removals after them are one
# sequence for every sharded format (core/checkpoint/files.py)
CELLS = [("fsdp", point) for point in KILL_POINTS] + [("deepspeed_stage_2", KILL_POINTS[0]),
                                                      ("deepspeed_stage_2", KILL_POINTS[2])]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, point", CELLS)
def test_a_save_killed_at_any_step_resumes_and_saves_on(hook, uninterrupted, tmp_path, strategy, point):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    killed = train(hook, out, strategy, SUITE_KILL_AT=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    wait_for_exit(out)  # rank 1 notices that rank 0 is gone
    resumed = train(hook, out, strategy, "--resume", str(out))  # saves at least twice more (steps 6 and 8)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stdout
    left = sorted(p.name for p in (out / "checkpoints").iterdir())  # nothing half-written: no .tmp, no .old
    assert left[0] == "last.ckpt" and all(re.fullmatch(r"step-\d{8}\.ckpt", name) for name in left[1:]), left
    state, reference = read(out / "checkpoints" / "last.ckpt"), uninterrupted(strategy)
    assert state["step"] == 8 and all(torch.equal(state["model"][k], reference[k]) for k in reference)
