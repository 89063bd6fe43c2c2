"""Multi-process runs end together: every command the READMEs show finishes on the default data, and
every way a run can stop (SIGTERM, Ctrl-C, an error one rank sees, a NaN on one rank) ends all ranks
(long before a collective's 30-minute timeout: each wait has the HANG deadline), with one checkpoint at one step
that `--resume` continues from."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.workloads import WORKLOADS
from common.bookkeeping import Bookkeeping
from common.config import RunConfig
from common.rundir import RunDir
from common.stopping import StopRequests
from core.checkpoint import load_checkpoint
from tests.conftest import HANG, ROOT, assert_whole_line, run
from tests.test_readme_blocks import PAGES
from tests.test_usability import EXPLAINED, WARNING

EMBEDDED = {"digits", "sinusoid", "fake"}  # datasets that need no files


def readme_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line in a ```bash block of the READMEs and the pages of docs/,
    each `a && b` split in two, comments dropped, duplicates once."""
    found = {}
    for readme in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                for command in filter(None, (part.strip() for part in line.split("&&"))):
                    found.setdefault(command, readme.relative_to(ROOT).as_posix())
    return [(where, command) for command, where in found.items()]


def why_not_run(command: str) -> str | None:
    """None for a command this test runs; else the reason it cannot run here."""
    words = shlex.split(command)
    if words[0] == "pip":
        return "an install command: CI's own set-up runs it"
    if words[:3] == ["python", "-m", "pytest"]:
        return "the test command itself"
    if "tests.contract" in command:
        return "the contract's generated programs: tests/test_contract.py runs them within CI's budget"
    if "benchmarks" in command:
        return "a benchmark: it measures minutes of training; tests/test_benchmarks.py covers its harness"
    if "--dataset" in words and words[words.index("--dataset") + 1] not in EMBEDDED:
        return f"needs the {words[words.index('--dataset') + 1]} files, which cannot be downloaded here"
    return None


def test_the_readmes_show_commands_of_every_workload():
    commands = " ".join(command for _, command in readme_commands())
    for workload in WORKLOADS:
        assert f"-m {workload}.train" in commands
    assert "torchrun" in commands and "--strategy ddp --devices 2" in commands


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("where, command", readme_commands(), ids=[c for _, c in readme_commands()])
def test_every_readme_command_runs(tmp_path, where, command):
    reason = why_not_run(command)
    if reason:
        pytest.skip(f"{where}: {reason}")
    words = shlex.split(command)
    assigned = {}  # NAME=value words before the command: its environment, as the shell reads them
    while "=" in words[0] and words[0].split("=")[0].isidentifier():
        name, _, value = words.pop(0).partition("=")
        assigned[name] = value
    if words[0] == "sdiff":
        result = subprocess.run(words, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert result.returncode in (0, 1) and "fabric" in result.stdout, result.stderr  # 1: the files differ
        return
    if words[0] == "torchrun":
        # --standalone: a free rendezvous port instead of 29500, which another test may hold (pytest -n 2)
        words = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    words += ["--max-steps", "3", "--out", str(tmp_path / "run")]
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}  # as a user runs it
    environment["PYTHONPATH"] = str(ROOT)
    # the README's commands are its CPU examples (`--devices 2` on a 1-GPU machine would be refused), and the
    # plain scripts have no --accelerator flag: hide any GPU from them
    environment["CUDA_VISIBLE_DEVICES"] = ""
    environment.update(assigned)
    result = subprocess.run(words, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, f"{where}: {command}\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    explained = EXPLAINED if words[:3] == [sys.executable, "-m", "torch.distributed.run"] else re.compile("^$")
    lines = (result.stdout + result.stderr).replace("\r", "\n").splitlines()  # DeepSpeed logs to stdout
    assert [line for line in lines if WARNING.search(line) and not explained.search(line)] == []  # none to act on
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3
    scores = [value for key, value in summary.items() if key not in ("config", "steps", "train_seconds")
              and not key.startswith("peak")]
    numbers = [v for value in scores for v in (value.values() if isinstance(value, dict) else [value])
               if isinstance(v, float)]
    assert numbers and all(v == v for v in numbers), summary  # scored: gan's FID, the autoencoder's PSNR, MAML's MSE


# --- stopping a run on 2 processes -------------------------------------------------------------------

def start(out: Path, *args: str, max_steps: int = 5000, one_pipe: bool = False) -> subprocess.Popen:
    """The autoencoder on its default data (digits) on 2 processes; long enough to be stopped mid-run. `one_pipe`:
    stderr into stdout, as a terminal shows both."""
    command = [sys.executable, "-m", "autoencoder.train", "--accelerator", "cpu", "--devices", "2",
               "--max-steps", str(max_steps),
               "--log-every", "10", "--out", str(out), *args]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if one_pipe else subprocess.PIPE, text=True)


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_training(out: Path, process: subprocess.Popen, timeout: float = HANG) -> None:
    deadline = time.monotonic() + timeout
    while not (out / "metrics.jsonl").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.multiprocess
# Each signal to each rank under ddp; fsdp and DeepSpeed once each, with the resume. The stop itself
# (common/stopping.py: a flag all-reduced at a step boundary) does not branch on the strategy, and its reduction is
# tested in this process below (test_a_stop_asked_on_another_rank_stops_this_one); what does, the checkpoint a
# strategy writes at the stop and its resume, runs here for each.
@pytest.mark.parametrize("strategy, signum, target", [
    ("ddp", signal.SIGTERM, "rank 0"), ("ddp", signal.SIGTERM, "rank 1"),
    ("ddp", signal.SIGINT, "rank 0"), ("ddp", signal.SIGINT, "rank 1"),
    ("fsdp", signal.SIGTERM, "rank 1"), ("deepspeed_stage_2", signal.SIGTERM, "rank 1")])
def test_a_signal_to_one_rank_stops_every_rank_at_one_step(tmp_path, strategy, signum, target):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    out = tmp_path / "run"
    process = start(out, "--strategy", strategy, one_pipe=True)
    wait_for_training(out, process)
    ranks = [process.pid, *other_ranks(process.pid)]
    assert len(ranks) == 2
    os.kill(ranks[0] if target == "rank 0" else ranks[1], signum)
    output, _ = process.communicate(timeout=HANG)  # stdout and stderr, as a terminal shows them
    assert process.returncode == (130 if signum == signal.SIGINT else 0), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not any(alive(pid) for pid in ranks), "a rank was left behind"
    name = signal.Signals(signum).name
    assert_whole_line(output, f"Stopped by {name} at step")  # below the bar, whose last state stays above
    step = int(re.search(rf"Stopped by {name} at step (\d+);", output).group(1))
    saved = out / "checkpoints" / "last.ckpt"
    assert 0 < step < 5000
    assert load_checkpoint(saved / "state.pt" if saved.is_dir() else saved)["step"] == step  # deepspeed: a folder
    assert not (out / "summary.json").exists()  # stopped, not finished
    if (signum, target) != (signal.SIGTERM, "rank 1"):
        return  # what a stop saves does not depend on the signal or the rank it reached: resumed once per strategy
    resumed = run(["-m", "autoencoder.train", "--accelerator", "cpu", "--devices", "2", "--strategy", strategy,
                   "--max-steps",
                   str(step + 5), "--log-every", "10", "--resume", str(out)], timeout=300)
    assert "Traceback" not in resumed.stderr
    assert f"Resumed from {saved} at step {step}, writing to {out}" in resumed.stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 5


def other_ranks(pid: int) -> list[int]:
    """The children of rank 0 (`pid`) that are ranks: started with CORE_PARENT_PID=pid in their environment.

    Rank 0 may also start short-lived helpers (a compiler probe, `ldconfig`); between fork and exec those still show
    rank 0's command line, but not an environment of their own, so the environment tells them apart."""
    found = []
    for child in children_of(pid):
        try:
            environment = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"CORE_PARENT_PID={pid}".encode() in environment:
            found.append(child)
    return found


def ranks_of(process: subprocess.Popen) -> list[int]:
    """Rank 0's pid and the other ranks', seen while rank 0 still runs."""
    seen = set()
    while process.poll() is None:
        seen.update(other_ranks(process.pid))
        time.sleep(0.02)
    return [process.pid, *seen]


@pytest.mark.multiprocess
def test_an_error_only_rank_0_sees_ends_every_rank_with_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    process = start(tmp_path / "a_file" / "run", "--strategy", "ddp")
    ranks = ranks_of(process)
    _, stderr = process.communicate(timeout=HANG)  # rank 1 would wait 30 minutes for rank 0 if nothing stopped it
    assert process.returncode == 2
    assert stderr.strip() == (f"python -m autoencoder.train: error: cannot write to the run directory "
                              f"{tmp_path / 'a_file' / 'run'} ({tmp_path / 'a_file'} is a file); pass a writable "
                              f"--out"), stderr
    assert len(ranks) == 2
    time.sleep(0.5)
    assert not any(alive(pid) for pid in ranks), "a rank was left behind"


ERROR_ON_RANK_1 = """
import os
import torch.nn.functional as F

if os.environ.get("RANK") == "1":  # bad input that only rank 1 meets, at its 5th step
    mse_loss, calls = F.mse_loss, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            raise ValueError("rank 1 met bad data")
        return mse_loss(*args, **kwargs)

    F.mse_loss = failing
"""


def start_with_hook(tmp_path: Path, hook: str, *args: str) -> subprocess.Popen:
    """The autoencoder under ddp on 2 processes, with `hook` run first in each (as sitecustomize)."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(hook)
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hook'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "autoencoder.train", "--strategy", "ddp", "--accelerator", "cpu",
               "--devices", "2", "--max-steps",
               "100", "--out", str(tmp_path / "run"), *args]
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.multiprocess
def test_an_error_only_rank_1_sees_ends_every_rank(tmp_path):
    process = start_with_hook(tmp_path, ERROR_ON_RANK_1)
    ranks = ranks_of(process)
    _, stderr = process.communicate(timeout=HANG)
    assert process.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    assert_whole_line(stderr, "python -m autoencoder.train: error: rank 1 met bad data")  # after rank 0's bar
    assert_whole_line(stderr, "[core] rank 1 exited with code 2; stopping all ranks.")
    assert len(ranks) == 2
    time.sleep(0.5)
    assert not any(alive(pid) for pid in ranks), "a rank was left behind"


NAN_ON_RANK_1 = """
import os
import torch.nn.functional as F

if os.environ.get("RANK") == "1":  # rank 1's loss turns NaN at its 25th step; rank 0 never sees one itself
    mse_loss, calls = F.mse_loss, [0]

    def poisoned(*args, **kwargs):
        calls[0] += 1
        loss = mse_loss(*args, **kwargs)
        return loss * float("nan") if calls[0] == 25 else loss

    F.mse_loss = poisoned
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_nan_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    process = start_with_hook(tmp_path, NAN_ON_RANK_1, "--log-every", "1", "--checkpoint-every", "20")
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert_whole_line(stderr, "python -m autoencoder.train: stopped: the loss is not finite at step 24")  # each rank's
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert state["step"] == 20
    assert all(torch.isfinite(value).all() for value in state["model"].values())


@pytest.mark.multiprocess
def test_a_batch_larger_than_each_rank_share_is_one_line(tmp_path):
    result = run(["-m", "autoencoder.train", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2",
                  "--batch-size", "200",
                  "--dataset", "fake", "--out", str(tmp_path / "run")], check=False, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "--batch-size 200 x 2 process(es) is more than the" in result.stderr


# --- the plain scripts' process group ----------------------------------------------------------------

@pytest.mark.parametrize("ending", ["finished", "SIGTERM", "error"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_plain_scripts_tear_their_process_group_down_on_every_way_out(tmp_path, monkeypatch, workload, ending):
    """As torchrun starts them (WORLD_SIZE 2, here a group of one process so that it runs in this one): the run
    finishes, stops at a SIGTERM (the stop's report returns early), or raises; the group is gone each time."""
    import importlib

    import torch.distributed as dist

    from common.config import merge

    module = importlib.import_module(f"{workload}.train_torch")
    real_init = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda backend: real_init(
        backend, store=dist.HashStore(), rank=0, world_size=1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    check = StopRequests.check

    def ask(self, step, loss, checkpoint):
        self.signals[signal.SIGTERM] += ending == "SIGTERM"
        if ending == "error":
            raise RuntimeError("a bug in the step")
        return check(self, step, loss, checkpoint)

    monkeypatch.setattr(StopRequests, "check", ask)
    config = merge(module.Config)(**WORKLOADS[workload].small, **WORKLOADS[workload].generated_data, max_steps=2,
                                  log_every=1, out=str(tmp_path / "run"))
    config.check()
    try:
        if ending == "error":
            with pytest.raises(RuntimeError, match="a bug in the step"):
                module.main(config)
        else:
            module.main(config)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the stop decision itself ------------------------------------------------------------------------

def test_a_stop_asked_on_another_rank_stops_this_one(tmp_path):
    def another_rank_asked(flags):  # what a reduction returns when rank 1 received SIGTERM
        return flags + torch.tensor([1.0, 0.0, 0.0])

    stop = StopRequests(reduce=another_rank_asked)
    assert stop.check(7, torch.tensor(1.0), tmp_path / "last.ckpt") and stop.reason == "SIGTERM"
    alone = StopRequests()
    assert not alone.check(7, torch.tensor(1.0), tmp_path / "last.ckpt") and alone.reason is None


def test_ranks_compare_every_10_steps_and_at_each_loss_check(tmp_path):
    compared = []
    stop = StopRequests(reduce=lambda flags: compared.append(flags) or flags)
    for step in range(30):
        stop.check(step, torch.tensor(1.0) if step == 4 else None, tmp_path / "last.ckpt")
    assert len(compared) == 4  # after steps 4 (a loss), 9, 19 and 29


def test_a_nan_on_another_rank_raises_on_this_one(tmp_path):
    stop = StopRequests(reduce=lambda flags: flags + torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(FloatingPointError, match="not finite at step 3 .on another process."):
        stop.check(3, torch.tensor(1.0), tmp_path / "last.ckpt")


SECOND_CTRL_C = """
import os, signal, time
from common.stopping import StopRequests
stop = StopRequests()
os.kill(os.getpid(), signal.SIGINT)
assert stop.signals[signal.SIGINT] == 1  # the first one only asks
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("not reached")
"""


def test_a_second_ctrl_c_stops_at_once_without_a_traceback():
    result = run(["-c", SECOND_CTRL_C], check=False, timeout=HANG)
    assert result.returncode == 130
    assert "not reached" not in result.stdout and "Traceback" not in result.stderr
    assert result.stderr.strip() == "Interrupted twice: stopping now, without a checkpoint of this step."


def test_ctrl_c_before_training_is_one_line(monkeypatch, capsys):
    from common.config import RunConfig, cli

    def main(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit) as exit_:
        cli(main, RunConfig, prog="python -m gan.train")
    assert exit_.value.code == 130
    assert capsys.readouterr().err == ("python -m gan.train: interrupted outside the training loop; nothing after "
                                       "the last checkpoint was saved\n")


def test_signals_act_at_once_again_after_the_loop(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequests()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.close()
    assert signal.getsignal(signal.SIGTERM) == before and signal.getsignal(signal.SIGINT) != stop._handle


# --- the bookkeeping after each step, shared by the six scripts --------------------------------------

def bookkeeping(tmp_path, stop=None, **config):
    state = {"step": 0, "model": torch.nn.Linear(2, 1)}
    run = RunDir(str(tmp_path / "run"), "test")
    return Bookkeeping(RunConfig(**config), state, run, stop or StopRequests(), "test", 4), state, run


def test_bookkeeping_logs_every_log_step_and_the_last_and_checkpoints_every_n(tmp_path):
    loop, state, run = bookkeeping(tmp_path, max_steps=7, log_every=3, checkpoint_every=2)
    due = []
    for step in range(7):
        assert not loop.end_step(step, torch.tensor(1.0), lambda: {"loss": float(step)})
        if loop.checkpoint_due():
            due.append(state["step"])
    loop.close()
    assert state["step"] == 7 and due == [2, 4, 6]
    assert [(r["step"], r["loss"]) for r in run.metrics()] == [(3, 2.0), (6, 5.0), (7, 6.0)]


def test_bookkeeping_checks_the_loss_on_log_steps_and_the_weights_before_a_checkpoint(tmp_path):
    loop, state, run = bookkeeping(tmp_path, max_steps=10, log_every=2, checkpoint_every=2)
    nan = torch.tensor(float("nan"))
    assert not loop.end_step(0, nan, lambda: {})  # step 1 is not a log step: not checked
    with pytest.raises(FloatingPointError, match="not finite at step 1"):
        loop.end_step(1, nan, lambda: {})
    assert run.metrics() == []  # nothing logged for a diverged step
    with torch.no_grad():
        state["model"].weight.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match="model has non-finite weights after step 2"):
        loop.checkpoint_due()
    with pytest.raises(FloatingPointError, match="non-finite weights"):
        loop.close()  # and before the final checkpoint


def test_bookkeeping_stops_when_another_rank_asks_at_the_next_comparison(tmp_path):
    stop = StopRequests(reduce=lambda flags: flags + torch.tensor([1.0, 0.0, 0.0]))  # rank 1 got SIGTERM
    loop, state, _ = bookkeeping(tmp_path, stop=stop, max_steps=100, log_every=50)
    stopped = [step for step in range(20) if loop.end_step(step, torch.tensor(1.0), lambda: {})]
    loop.close()
    assert stopped[0] == 9 and stop.reason == "SIGTERM" and state["step"] == 20  # ranks compare every 10 steps
    assert signal.getsignal(signal.SIGTERM) != stop._handle

