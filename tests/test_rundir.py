"""Runs never lose work: where a run writes (one rule), what a resume continues from, `--resume auto`, the
default checkpoint cadence, logs that agree after a kill, and errors that keep their cause."""
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autoencoder.config import Config as AutoencoderConfig
from common.config import merge, parse
from common.resume import RESUMABLE_CHANGES, resolve_run
from common import rundir
from common.rundir import RunDir
from core.cli import FabricFlags
from tests.conftest import HANG, ROOT, TORCHRUN, run

def load_checkpoint(path: Path) -> dict:
    """A checkpoint's content, written by a wrapped (core's marker around it) or a plain script."""
    saved = torch.load(path, weights_only=True)
    return saved["state"] if saved.get("format") == "core-checkpoint" else saved


GAN_SMALL = ["--batch-size", "8", "--ngf", "8", "--ndf", "8", "--nz", "16", "--eval-samples", "8"]


def make_run(path: Path, checkpoint_is_folder: bool = False, **config) -> Path:
    """A run directory as a script leaves it: config.json and checkpoints/last.ckpt (a folder for fsdp and
    DeepSpeed)."""
    last = path / "checkpoints" / "last.ckpt"
    (last if checkpoint_is_folder else last.parent).mkdir(parents=True)
    (last / "state.pt" if checkpoint_is_folder else last).write_bytes(b"")
    (path / "config.json").write_text(json.dumps({**vars(AutoencoderConfig()), **config}))
    return path


def parsed(*argv) -> AutoencoderConfig:
    return parse(merge(AutoencoderConfig, FabricFlags), list(argv))


# --- the one rule for where a run writes ----------------------------------------------------------

@pytest.mark.parametrize("folder", [False, True], ids=["file", "fsdp-or-deepspeed-folder"])
def test_a_resume_without_out_continues_in_the_run_directory_the_checkpoint_belongs_to(tmp_path, folder):
    run_dir = make_run(tmp_path / "run", checkpoint_is_folder=folder)
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    for given in (run_dir, checkpoint):
        config = AutoencoderConfig(resume=str(given))
        resolve_run(config)
        assert (config.out, config.resume) == (str(run_dir), str(checkpoint))


def test_a_checkpoint_outside_a_run_directory_needs_out(tmp_path):
    (tmp_path / "plain.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not inside a run directory .* pass --out DIR"):
        resolve_run(AutoencoderConfig(resume=str(tmp_path / "plain.ckpt")))
    config = AutoencoderConfig(resume=str(tmp_path / "plain.ckpt"), out=str(tmp_path / "new"))
    resolve_run(config)
    assert config.out == str(tmp_path / "new")


def test_a_directory_that_holds_a_run_is_written_only_by_its_resume(tmp_path):
    run_dir, other = make_run(tmp_path / "run"), make_run(tmp_path / "other")
    with pytest.raises(ValueError, match=r"already holds a run \(config.json, checkpoints/\); continue it with "
                                         r"--resume .*run \(or --resume auto\), or pass a new --out"):
        resolve_run(AutoencoderConfig(out=str(run_dir)))
    with pytest.raises(ValueError, match="already holds another run"):
        resolve_run(AutoencoderConfig(out=str(run_dir), resume=str(other)))
    resolve_run(AutoencoderConfig(out=str(run_dir), resume=str(run_dir)))  # its own resume
    (tmp_path / "empty").mkdir()
    resolve_run(AutoencoderConfig(out=str(tmp_path / "empty")))  # an empty folder holds no run


def test_resume_auto_starts_fresh_in_an_empty_out_and_continues_a_used_one(tmp_path, capsys):
    with pytest.raises(ValueError, match="--resume auto continues the run in --out, so it needs one"):
        resolve_run(AutoencoderConfig(resume="auto"))
    fresh = AutoencoderConfig(resume="auto", out=str(tmp_path / "job"))
    resolve_run(fresh)
    assert (fresh.out, fresh.resume) == (str(tmp_path / "job"), "")
    assert "no checkpoint in" in capsys.readouterr().out
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "config.json").write_text("{}")  # killed before its first checkpoint: start again there
    resolve_run(AutoencoderConfig(resume="auto", out=str(tmp_path / "job")))
    make_run(tmp_path / "used")
    used = AutoencoderConfig(resume="auto", out=str(tmp_path / "used"))
    resolve_run(used)
    assert used.resume == str(tmp_path / "used" / "checkpoints" / "last.ckpt")


def test_a_resume_keeps_the_runs_own_flags_unless_given_again(tmp_path):
    run_dir = make_run(tmp_path / "run", max_steps=300, latent=8, strategy="ddp", devices="2", data_root="/elsewhere")
    config = parsed("--resume", str(run_dir))
    assert (config.max_steps, config.latent, config.strategy, config.devices) == (300, 8, "ddp", "2")
    assert config.data_root == "/elsewhere"  # the run's too; typed again where the files lie elsewhere
    assert parsed("--resume", str(run_dir), "--data-root", "here").data_root == "here"
    assert parsed("--resume", str(run_dir), "--max-steps", "500").max_steps == 500
    with pytest.raises(SystemExit):  # a flag that changes what is computed, given differently
        parsed("--resume", str(run_dir), "--latent", "16")


def test_a_checkpoint_of_another_workload_names_the_workload(tmp_path):
    run_dir = make_run(tmp_path / "run", workload="autoencoder")
    with pytest.raises(ValueError, match=r"a checkpoint of the autoencoder workload; resume it with python -m "
                                         r"autoencoder.train \(or autoencoder.train_torch\)"):
        resolve_run(AutoencoderConfig(resume=str(run_dir)), "gan")
    resolve_run(AutoencoderConfig(resume=str(run_dir)), "autoencoder")


def test_flags_that_change_no_computation_may_change_on_resume(tmp_path):
    run_dir = make_run(tmp_path / "run", logger="csv")
    config = parsed("--resume", str(run_dir), "--logger", "none", "--log-every", "7")
    assert (config.logger, config.log_every) == ("none", 7)
    assert {"logger", "sample_every", "eval_samples", "eval_tasks", "eval_queries"} <= RESUMABLE_CHANGES


class Ranks:
    """Collectives as one rank of a run sees them: rank 0's broadcasts (scripted, or this rank's own values when
    it is rank 0), and all_reduce(min) with the other ranks' answer (one for all, or a list, one per call)."""

    def __init__(self, broadcasts=None, others=True):
        self.broadcasts = None if broadcasts is None else iter(broadcasts)
        self.others = iter(others) if isinstance(others, list) else None
        self.always = others

    def broadcast(self, value):
        return value if self.broadcasts is None else next(self.broadcasts)

    def all_reduce(self, tensor, reduce_op):
        assert reduce_op == "min"
        others = next(self.others) if self.others is not None else self.always
        return torch.minimum(tensor, torch.tensor(int(others)))


def test_ranks_that_find_different_checkpoints_all_stop(tmp_path):
    """Each process resolves --resume auto itself; one on a node that does not see rank 0's checkpoint (a
    node-local --out) must not start afresh beside ranks that resume, and the others stop with it. (Broadcasts:
    the path, rank 0's marker, then the checkpoint to resume.)"""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".rank-0-host-1-2").touch()
    last = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match="different checkpoints .* every node sees"):
        RunDir(str(tmp_path / "run"), "gan", write=False, collectives=Ranks([str(tmp_path / "run"), "host-1-2", last]))
    with pytest.raises(ValueError, match="different checkpoints"):  # rank 0, whose resume another rank does not share
        RunDir(str(tmp_path / "run"), "gan", write=True, collectives=Ranks(others=[True, False]), resume=last)
    RunDir(str(tmp_path / "run"), "gan", write=False, collectives=Ranks([str(tmp_path / "run"), "host-1-2", ""]))


def test_a_run_directory_that_one_rank_does_not_see_stops_every_rank(tmp_path):
    """Rank 0's marker is on another node's disk: that rank stops at once, naming the requirement and rank 0's
    host (a hostname with hyphens kept whole); rank 0 stops too, leaving no marker and no --out it created."""
    with pytest.raises(ValueError, match=r"this process does not see the run directory .*\(on host gpu-node-01\)"):
        RunDir(str(tmp_path / "run"), "gan", write=False, collectives=Ranks([str(tmp_path / "run"), "gpu-node-01-1-2"],
                                                                            others=False))
    with pytest.raises(ValueError, match="another node's process does not see .* every node sees"):
        RunDir(str(tmp_path / "out"), "gan", write=True, collectives=Ranks(others=False))
    assert not (tmp_path / "out").exists()
    RunDir(str(tmp_path / "out"), "gan", write=True, collectives=Ranks())
    assert not (tmp_path / "out").exists()  # it appears with the run's first file


def test_default_run_directories_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("common.rundir.time.strftime", lambda _: "20260101-000000")  # the same second
    paths = [RunDir("", "gan").path for _ in range(3)]
    assert [p.name for p in paths] == ["gan-20260101-000000", "gan-20260101-000000-2", "gan-20260101-000000-3"]
    assert all(p.is_dir() for p in paths)


def test_two_default_runs_started_together_end_in_two_directories(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gan.train", *GAN_SMALL, "--max-steps", "2", "--accelerator", "cpu"]
    processes = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
    for process in processes:
        assert process.wait(timeout=120) == 0, process.communicate()
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all((r / "summary.json").is_file() for r in runs)


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("script", ["gan.train", "gan.train_torch"])
def test_reusing_a_finished_runs_out_without_resume_exits_2_and_changes_nothing(tmp_path, script):
    out = tmp_path / "run"
    run(["-m", script, *GAN_SMALL, "--max-steps", "2", "--out", str(out)])
    before = digest(out)
    result = run(["-m", script, *GAN_SMALL, "--max-steps", "4", "--out", str(out)], check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"python -m {script}: error: --out {out} already holds a run (config.json, metrics.jsonl, summary.json, "
        f"checkpoints/); continue it with --resume {out} (or --resume auto), or pass a new --out"]
    assert digest(out) == before


# --- every resume form, on the default data ---------------------------------------------------------

@pytest.mark.slow
# each workload once and each variant at least once: the resume forms are common/rundir's, which every script
# calls the same way (both of the GAN's variants resume through --resume auto in the test below)
@pytest.mark.parametrize("workload, variant", [("gan", "train"), ("autoencoder", "train_torch"),
                                               ("metalearn", "train")])
def test_each_resume_form_continues_in_the_right_directory(tmp_path, workload, variant):
    """run dir -> last.ckpt without --out -> --resume RUN_DIR: each continues the run in its own directory,
    with its own flags, and the next finds the newest step."""
    script, out = f"{workload}.{variant}", tmp_path / "run"
    small = {"gan": GAN_SMALL, "autoencoder": ["--batch-size", "8", "--width", "4"],
             "metalearn": ["--hidden", "16", "--eval-tasks", "10", "--lr-schedule", "constant"]}[workload]
    # (MAML's default cosine schedule ends at --max-steps, which a resume therefore keeps: tested elsewhere)
    run(["-m", script, *small, "--max-steps", "2", "--log-every", "1", "--out", str(out)])
    first = run(["-m", script, "--resume", str(out / "checkpoints" / "last.ckpt"), "--max-steps", "3"])
    assert f"Resumed from {out / 'checkpoints' / 'last.ckpt'} at step 2, writing to {out}" in first.stdout
    run(["-m", script, "--resume", str(out), "--max-steps", "4"])
    saved = load_checkpoint(out / "checkpoints" / "last.ckpt")
    assert saved["step"] == 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    config = json.loads((out / "config.json").read_text())
    assert config["log_every"] == 1  # the run's own flag, kept without retyping it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written elsewhere


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["train", "train_torch"])
def test_resume_auto_on_an_empty_then_a_used_out(tmp_path, variant):
    command = ["-m", f"gan.{variant}", *GAN_SMALL, "--out", str(tmp_path / "job"), "--resume", "auto"]
    first = run([*command, "--max-steps", "2"])
    assert "--resume auto: no checkpoint in" in first.stdout
    second = run([*command, "--max-steps", "3"])
    assert "Resumed from" in second.stdout and "at step 2" in second.stdout
    assert load_checkpoint(tmp_path / "job" / "checkpoints" / "last.ckpt")["step"] == 3


@pytest.mark.slow
def test_the_printed_resume_command_continues_to_the_original_max_steps(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "autoencoder.train", "--max-steps", "300", "--log-every", "10",
                                "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=HANG)
    assert process.returncode == 130, stderr
    printed = re.search(r"Resume with: (.*)$", stdout, re.M).group(1)
    assert printed == f"python -m autoencoder.train --resume {out}"
    run(printed.split()[1:])
    assert json.loads((out / "summary.json").read_text())["steps"] == 300


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_2"])
def test_a_sharded_checkpoint_folder_resumes_without_out(tmp_path, strategy):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    out = tmp_path / "run"
    common = ["-m", "autoencoder.train", "--accelerator", "cpu", "--strategy", strategy, "--devices", "2",
              "--batch-size", "8", "--width", "4"]
    run([*common, "--max-steps", "2", "--out", str(out)], timeout=300)
    assert (out / "checkpoints" / "last.ckpt").is_dir()
    run(["-m", "autoencoder.train", "--resume", str(out / "checkpoints" / "last.ckpt"), "--max-steps", "3"],
        timeout=300)
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert not (out / "checkpoints" / "last.ckpt" / "config.json").exists()  # not a run inside the checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_converted_checkpoint_resumes_in_the_plain_script_as_the_docs_show(tmp_path):
    """docs/checkpoints.md: python -m core.convert RUN plain.ckpt, then
    python -m gan.train_torch --resume plain.ckpt --out DIR."""
    run(["-m", "gan.train", *GAN_SMALL, "--accelerator", "cpu", "--strategy", "fsdp", "--devices", "2",
         "--max-steps", "2", "--out", str(tmp_path / "fsdp")], timeout=300)
    run(["-m", "core.convert", str(tmp_path / "fsdp"), str(tmp_path / "plain.ckpt")])
    refused = run(["-m", "gan.train_torch", "--resume", str(tmp_path / "plain.ckpt")], check=False)
    assert refused.returncode == 2 and "pass --out DIR" in refused.stderr
    run(["-m", "gan.train_torch", *GAN_SMALL, "--resume", str(tmp_path / "plain.ckpt"), "--out",
         str(tmp_path / "plain"), "--max-steps", "3"])
    assert load_checkpoint(tmp_path / "plain" / "checkpoints" / "last.ckpt")["step"] == 3


# --- bounded loss on a kill: the default cadence, restarts that continue --------------------------------

def test_the_default_cadence_checkpoints_every_500_steps():
    assert AutoencoderConfig().checkpoint_every == 500


def final_tensors(path: Path) -> dict:
    state = load_checkpoint(path / "checkpoints" / "last.ckpt")
    return {f"{key}.{name}": value for key, value in state.items() if isinstance(value, dict) and "step" not in key
            for name, value in value.items() if isinstance(value, torch.Tensor)}


@pytest.mark.slow
def test_a_default_flags_run_killed_late_resumes_from_the_cadences_checkpoint(tmp_path):
    """The autoencoder's default flags to 600 steps: SIGKILL after the step-500 checkpoint, resume, and the
    weights equal an uninterrupted run's bitwise."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "autoencoder.train", "--max-steps", "600"]
    killed = subprocess.Popen([*command, "--out", str(tmp_path / "killed")], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoint, deadline = tmp_path / "killed" / "checkpoints" / "last.ckpt", time.monotonic() + 240
    while not checkpoint.exists():
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert load_checkpoint(checkpoint)["step"] == 500 and not (tmp_path / "killed" / "summary.json").exists()
    run(["-m", "autoencoder.train", "--resume", str(tmp_path / "killed")])
    run(["-m", "autoencoder.train", "--max-steps", "600", "--out", str(tmp_path / "reference")])
    a, b = final_tensors(tmp_path / "reference"), final_tensors(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps_json = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    steps_csv = [int(line.split(",")[0]) for line in (tmp_path / "killed" / "metrics.csv").read_text().splitlines()[1:]]
    assert steps_json == steps_csv == [50 * i for i in range(1, 13)]


def start_and_kill_a_worker(job: list[str], checkpoint: Path, env: dict, module: str) -> subprocess.Popen:
    """Start a torchrun job; once `checkpoint` exists, SIGKILL its second worker (the agent's child)."""
    first = subprocess.Popen(job, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not checkpoint.exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    agent_children = subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()
    workers = [int(pid) for pid in agent_children if module in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    return first


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_requeued_torchrun_job_with_resume_auto_continues_bitwise(tmp_path):
    """What SLURM --requeue or a scheduler's retry does: the same command again after a worker was killed."""
    args = ["-m", "gan.train_torch", *GAN_SMALL, "--max-steps", "120", "--checkpoint-every", "40", "--log-every",
            "10"]
    job = [sys.executable, *TORCHRUN, *args, "--out", str(tmp_path / "job"), "--resume", "auto"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = start_and_kill_a_worker(job, tmp_path / "job" / "checkpoints" / "last.ckpt", env, "gan.train_torch")
    first.communicate(timeout=120)
    assert first.returncode != 0 and not (tmp_path / "job" / "summary.json").exists()
    requeued = subprocess.run(job, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert "Resumed from" in requeued.stdout
    run([*TORCHRUN, *args, "--out", str(tmp_path / "reference")], timeout=300)
    a, b = final_tensors(tmp_path / "reference"), final_tensors(tmp_path / "job")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# a plain script under torchrun (rendezvous store not shared across restarts: docs/runs.md), and the wrapped GAN
# under core's own store; each long enough that the kill lands between two checkpoints. The other plain scripts
# restart the same way (torchrun starts the same command again, and --resume auto finds last.ckpt): their own
# resume is test_each_resume_form_continues_in_the_right_directory's, per script
RESTARTED = {
    "gan.train": ["--strategy", "ddp", "--devices", "2", *GAN_SMALL, "--max-steps", "120"],
    "gan.train_torch": [*GAN_SMALL, "--max-steps", "120"],
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("module", RESTARTED)
def test_torchrun_max_restarts_continues_a_job_whose_worker_was_killed_bitwise(tmp_path, module):
    """torchrun's own restart: one worker SIGKILLed after a checkpoint; torchrun starts both again with the same
    argv, `--resume auto` continues from the checkpoint, and the weights end as an uninterrupted run's."""
    args = ["-m", module, *RESTARTED[module], "--checkpoint-every", "40", "--log-every", "10"]
    restarting = [*TORCHRUN[:2], "--max-restarts", "1", *TORCHRUN[2:]]
    job = [sys.executable, *restarting, *args, "--out", str(tmp_path / "job"), "--resume", "auto"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if module.endswith("_torch"):  # what docs/runs.md tells plain users to set; core connects by its own keys
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    first = start_and_kill_a_worker(job, tmp_path / "job" / "checkpoints" / "last.ckpt", env, module)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    assert "Resumed from" in stdout and (tmp_path / "job" / "summary.json").exists()
    run([*TORCHRUN, *args, "--out", str(tmp_path / "reference")], timeout=300)
    a, b = final_tensors(tmp_path / "reference"), final_tensors(tmp_path / "job")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- errors keep their cause ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_missing_shard_file_is_named_and_the_traceback_switch_shows_the_cause(tmp_path):
    out = tmp_path / "run"
    common = ["-m", "autoencoder.train", "--accelerator", "cpu", "--strategy", "fsdp", "--devices", "2",
              "--batch-size", "8", "--width", "4"]
    run([*common, "--max-steps", "2", "--out", str(out)], timeout=300)
    shard = sorted((out / "checkpoints" / "last.ckpt").glob("*.distcp"))[-1]
    shard.unlink()
    # named itself: from the run directory, the resume would go on from the kept step-2 checkpoint instead
    last = str(out / "checkpoints" / "last.ckpt")
    result = run([*common, "--resume", last, "--max-steps", "3"], check=False, timeout=300)
    assert result.returncode != 0
    message = [line for line in result.stderr.splitlines() if line.startswith("python -m autoencoder.train")]
    assert message and shard.name in message[0] and "does not match the model" not in message[0], result.stderr
    traced = run([*common, "--resume", last, "--max-steps", "3"], check=False, timeout=300,
                 env={"SUITE_TRACEBACK": "1"})
    assert "Traceback" in traced.stderr and "CheckpointError" in traced.stderr and shard.name in traced.stderr


# --- two runs at once --------------------------------------------------------------------------------

def test_two_new_runs_in_one_named_out_at_once_the_second_gets_one_line(tmp_path):
    """Both passed resolve_run's check, nothing was written yet: the first to write its first file takes the
    directory, the other is refused, whether it comes while the first writes or after."""
    out = tmp_path / "run"
    config = AutoencoderConfig(out=str(out))
    first, second, third = (RunDir(str(out), "autoencoder") for _ in range(3))
    (out.mkdir(), (out / rundir.CLAIM).write_text(f"{socket.gethostname()} {os.getpid()}"))  # first, mid-start
    with pytest.raises(ValueError, match="another run is starting there .* pass a new --out"):
        second.start(config, 0)
    (out / rundir.CLAIM).unlink()
    first.start(config, 0)
    assert (out / "config.json").is_file() and not (out / rundir.CLAIM).exists()
    with pytest.raises(ValueError, match=r"already holds a run \(config.json\), started since this one"):
        third.start(config, 0)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = tmp_path / "other"
    (other.mkdir(), (other / rundir.CLAIM).write_text(f"{socket.gethostname()} {gone.stdout.strip()}"))
    RunDir(str(other), "autoencoder").start(AutoencoderConfig(out=str(other)), 0)  # a run killed mid-start
    assert (other / "config.json").is_file() and not (other / rundir.CLAIM).exists()


def test_a_claim_that_keeps_going_stale_or_is_not_written_yet_is_refused_in_one_line(tmp_path, monkeypatch):
    """Two races of the claim: another process between its open and its write (an empty claim) is named as such,
    and a stale claim that is back at every try is refused (it ended in an UnboundLocalError)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.CLAIM).write_text("")  # its process has opened it, not yet written its name
    with pytest.raises(ValueError, match=r"another run is starting there \(a process that has not written its name"):
        RunDir(str(out), "autoencoder").start(AutoencoderConfig(out=str(out)), 0)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = f"{socket.gethostname()} {gone.stdout.strip()}"
    opened = os.open

    def a_stale_claim_every_time(path, flags, *args):  # another run killed mid-start, again and again
        if str(path).endswith(rundir.CLAIM) and flags & os.O_EXCL:
            Path(path).write_text(stale)
            raise FileExistsError(path)
        return opened(path, flags, *args)
    monkeypatch.setattr(os, "open", a_stale_claim_every_time)
    (out / rundir.CLAIM).unlink()
    with pytest.raises(ValueError, match="other runs keep starting there; pass a new --out"):
        RunDir(str(out), "autoencoder").start(AutoencoderConfig(out=str(out)), 0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_a_plain_resume_of_a_run_trained_in_another_precision_says_so(tmp_path, capsys, precision):
    run_dir = make_run(tmp_path / "run", precision=precision, workload="autoencoder")
    parse(AutoencoderConfig, ["--resume", str(run_dir)])  # the plain script's flags: no --precision
    said = capsys.readouterr().err
    assert ("--precision bf16-mixed; this script computes in float32" in said) == (precision == "bf16-mixed"), said
    parsed("--resume", str(run_dir))  # the wrapped script keeps the run's precision: nothing to say
    assert "float32" not in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_the_last_checkpoints_are_kept_as_hard_links_and_the_oldest_removed(tmp_path, layout):
    """--keep-checkpoints 3: after each save, checkpoints/step-N.ckpt links last.ckpt's bytes (no second copy), and
    only the newest 3 stay; a later save writes last.ckpt anew without touching them."""
    directory = RunDir(str(tmp_path / "run"), "autoencoder")
    directory.start(AutoencoderConfig(keep_checkpoints=3), 0)
    for step in range(1, 6):
        directory.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        fresh = directory.checkpoint.with_name(".new")  # a save writes anew and renames over last.ckpt
        if layout == "file":
            fresh.write_text(f"step {step}")
        else:
            fresh.mkdir()
            (fresh / "__0_0.distcp").write_text(f"step {step}")
        if directory.checkpoint.is_dir():
            shutil.rmtree(directory.checkpoint)
        os.replace(fresh, directory.checkpoint)
        directory.keep_checkpoint(step)
    assert [step for step, _ in rundir.kept_checkpoints(directory.path)] == [3, 4, 5]
    for step, path in rundir.kept_checkpoints(directory.path):
        inner = Path("__0_0.distcp") if layout == "directory" else Path()
        assert (path / inner).read_text() == f"step {step}"
    newest = directory.checkpoint / ("__0_0.distcp" if layout == "directory" else "")
    kept = rundir.kept_checkpoints(directory.path)[-1][1] / ("__0_0.distcp" if layout == "directory" else "")
    assert os.stat(newest).st_ino == os.stat(kept).st_ino  # a hard link


def test_keep_checkpoints_1_keeps_last_ckpt_alone_and_0_is_refused(tmp_path):
    directory = RunDir(str(tmp_path / "run"), "autoencoder")
    directory.start(AutoencoderConfig(keep_checkpoints=1), 0)
    directory.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    directory.checkpoint.write_text("x")
    directory.keep_checkpoint(1)
    assert sorted(p.name for p in directory.checkpoint.parent.iterdir()) == ["last.ckpt"]
    result = run(["-m", "autoencoder.train", "--keep-checkpoints", "0"], check=False)
    assert result.returncode == 2 and "error: --keep-checkpoints must be >= 1, got 0" in result.stderr
