"""fabric.save(..., background=True) and --save-in-background: the checkpoint holds the state of the call, not
what training did after it; a failed write is raised by the next save, once, with the previous checkpoint whole;
a load waits for the write; a kill mid-write loses nothing; DeepSpeed refuses it with the reason."""
import errno
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from core import Fabric, checkpoint
from core.checkpoint import space
from tests.conftest import ROOT, run


def trained(fabric):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    step(fabric, model, optimizer)
    return {"model": model, "optimizer": optimizer, "step": 1}


def step(fabric, model, optimizer):
    fabric.backward(model(torch.randn(8, 16)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def saved_tensors(path) -> dict:
    """Every tensor and number of a checkpoint, by its path of keys."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (torch.Tensor, int, float)):
            flat[prefix] = torch.as_tensor(value)
    walk("", checkpoint.read(path))
    return flat


def test_a_background_save_holds_the_state_of_its_call_not_what_training_did_after(tmp_path, monkeypatch):
    fabric = Fabric(accelerator="cpu")
    state = trained(fabric)
    fabric.save(tmp_path / "foreground.ckpt", state)
    release, real = threading.Event(), checkpoint.files.atomic_save
    monkeypatch.setattr(checkpoint.files, "atomic_save", lambda obj, target: release.wait(30) and real(obj, target))
    saving = fabric.save(tmp_path / "background.ckpt", state, background=True)
    for _ in range(3):  # training goes on before it writes: in-place updates of weights, moments and statistics
        step(fabric, state["model"], state["optimizer"])
    state["step"] = 4
    release.set()
    fabric.wait_for_save()
    assert saving.done() and saving.exception() is None
    expected, got = saved_tensors(tmp_path / "foreground.ckpt"), saved_tensors(tmp_path / "background.ckpt")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_background_save_that_finds_no_space_is_raised_by_the_next_save_and_keeps_the_previous(tmp_path,
                                                                                               monkeypatch):
    fabric = Fabric(accelerator="cpu")
    state = trained(fabric)
    path = tmp_path / "last.ckpt"
    fabric.save(path, state)
    before = path.read_bytes()

    def full(self, data):
        self.error = OSError(errno.ENOSPC, "No space left on device")
        raise self.error
    monkeypatch.setattr(space.Recorder, "write", full)
    saving = fabric.save(path, state, background=True)  # returns: the write fails in its thread
    assert isinstance(saving.exception(timeout=60), checkpoint.NoSpace)
    monkeypatch.undo()
    with pytest.raises(checkpoint.NoSpace, match=r"No space left to save the checkpoint .*last.ckpt"):
        fabric.save(path, state)  # the next save says so first, and does not write
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    fabric.save(path, {**state, "step": 2})  # said once: the save after it writes
    assert checkpoint.read(path)["step"] == 2


def test_a_load_waits_for_the_background_save_of_its_path(tmp_path, monkeypatch):
    fabric = Fabric(accelerator="cpu")
    state = trained(fabric)
    path = tmp_path / "last.ckpt"
    fabric.save(path, {**state, "step": 1})
    writing, release = threading.Event(), threading.Event()
    real = checkpoint.files.atomic_save

    def slow(obj, target):
        writing.set()
        release.wait(30)
        real(obj, target)
    monkeypatch.setattr(checkpoint.files, "atomic_save", slow)
    fabric.save(path, {**state, "step": 2}, background=True)
    assert writing.wait(30)
    threading.Timer(0.5, release.set).start()  # the load below must wait for it, not read step 1
    assert fabric.load(path)["step"] == 2


def test_the_next_save_waits_for_what_runs_once_a_background_save_is_written(tmp_path):
    """The Future's callbacks (the scripts keep a checkpoint from one) run in the writer thread after the Future
    is done: the next save, here in the foreground, waits for them too, so they see the file they were for."""
    fabric = Fabric(accelerator="cpu")
    state = trained(fabric)
    path, seen = tmp_path / "last.ckpt", []

    def keep(saved):
        threading.Event().wait(0.5)
        seen.append(checkpoint.read(path)["step"])
    fabric.save(path, state, background=True).add_done_callback(keep)
    fabric.save(path, {**state, "step": 2})
    assert seen == [1]


KILLED = """
import os, signal, sys, threading, torch
from torch import nn
from core import Fabric, checkpoint
fabric = Fabric(accelerator="cpu")
model = fabric.setup(nn.Linear(64, 64))
fabric.save(sys.argv[1], {"model": model, "step": 1})
real = checkpoint.files.atomic_write
def killed(path, write, **kwargs):
    def half(f):
        f.write(b"x" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write, in the writer thread
    real(path, half, **kwargs)
checkpoint.files.atomic_write = killed
fabric.save(sys.argv[1], {"model": model, "step": 2}, background=True)
threading.Event().wait(60)
"""


def test_a_kill_while_a_background_save_writes_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    result = subprocess.run([sys.executable, "-c", KILLED, str(path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert any(p.name.startswith(".last.ckpt.tmp-") for p in tmp_path.iterdir())  # the write it killed
    fabric = Fabric(accelerator="cpu")
    assert fabric.load(path)["step"] == 1  # whole, and the temporary cleared
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_save_in_background_under_deepspeed_is_refused_with_the_reason():
    result = run(["-m", "autoencoder.train", "--strategy", "deepspeed_stage_2", "--save-in-background"],
                 check=False, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--save-in-background: --strategy deepspeed_stage_2 writes its engines' own files" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_a_run_that_saves_in_the_background_keeps_the_same_checkpoints(tmp_path, strategy):
    """The autoencoder with --save-in-background: its kept checkpoints equal those of a run that waits for each
    save (under ddp and fsdp the write's collectives run on a group of their own, beside training's)."""
    devices = [] if strategy == "single" else ["--strategy", strategy, "--devices", "2"]
    for name, extra in (("foreground", []), ("background", ["--save-in-background"])):
        run(["-m", "autoencoder.train", *devices, "--max-steps", "6", "--checkpoint-every", "2",
             "--keep-checkpoints", "3", "--out", str(tmp_path / name), *extra], timeout=300)
    kept = sorted(p.name for p in (tmp_path / "foreground" / "checkpoints").iterdir())
    assert kept == sorted(p.name for p in (tmp_path / "background" / "checkpoints").iterdir())
    assert "step-00000002.ckpt" in kept and "step-00000004.ckpt" in kept
    for name in kept:
        expected = saved_tensors(tmp_path / "foreground" / "checkpoints" / name)
        got = saved_tensors(tmp_path / "background" / "checkpoints" / name)
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), name
