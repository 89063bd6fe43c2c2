"""Nothing lost under crashes, preemption, divergence and bad input, for all three workloads."""
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.workloads import WORKLOADS as REGISTRY
from benchmarks.workloads import flags
from core.checkpoint import load_checkpoint
from tests.conftest import HANG, ROOT, assert_whole_line, built_once, run

# tiny settings that still take a few seconds, so a kill lands mid-run
WORKLOADS = {name: flags({**w.generated_data, **w.small, "max_steps": w.crash_steps[0], "log_every": w.crash_steps[1],
                          "checkpoint_every": 7}) for name, w in REGISTRY.items()}


def start(workload, out, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", f"{workload}.train", *WORKLOADS[workload], *extra, "--out", str(out)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(out, process, timeout=HANG):
    deadline = time.monotonic() + timeout
    checkpoint = out / "checkpoints" / "last.ckpt"
    while not checkpoint.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)


def final_weights(out) -> dict:
    state = load_checkpoint(out / "checkpoints" / "last.ckpt")
    return {f"{key}.{name}": value for key, value in state.items() if isinstance(value, dict) and "step" not in key
            for name, value in value.items() if isinstance(value, torch.Tensor)}


def assert_killed_mid_run(process, out, max_steps):
    """The kill must have ended a run that was still going: a run that had finished before the signal
    would make the resume below a no-op and the comparison pass on its own."""
    assert process.wait() == -signal.SIGKILL, f"the run exited {process.returncode} before it was killed"
    assert 0 < load_checkpoint(out / "checkpoints" / "last.ckpt")["step"] < max_steps, "the kill did not land mid-run"
    assert not (out / "summary.json").exists(), "the run had finished when it was killed"


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, workload):
    reference = start(workload, tmp_path / "reference")
    killed = start(workload, tmp_path / "killed")
    wait_for_checkpoint(tmp_path / "killed", killed)
    time.sleep(0.3)  # somewhere between two checkpoints
    killed.send_signal(signal.SIGKILL)
    assert_killed_mid_run(killed, tmp_path / "killed", REGISTRY[workload].crash_steps[0])
    assert reference.wait(timeout=240) == 0, reference.communicate()
    run(["-m", f"{workload}.train", *WORKLOADS[workload], "--resume", str(tmp_path / "killed")])
    assert_bitwise_equal(final_weights(tmp_path / "reference"), final_weights(tmp_path / "killed"))
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # each step logged once across the crash


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_then_resume_under_ddp(tmp_path):
    extra = ["--accelerator", "cpu", "--strategy", "ddp", "--devices", "2"]
    reference = start("gan", tmp_path / "reference", *extra)
    assert reference.wait(timeout=240) == 0, reference.communicate()
    killed = start("gan", tmp_path / "killed", *extra)
    wait_for_checkpoint(tmp_path / "killed", killed)
    time.sleep(0.5)
    killed.send_signal(signal.SIGKILL)  # rank 0, the launcher
    assert_killed_mid_run(killed, tmp_path / "killed", REGISTRY["gan"].crash_steps[0])
    time.sleep(1.5)  # rank 1 notices that rank 0 is gone and exits
    run(["-m", "gan.train", *WORKLOADS["gan"], *extra, "--resume", str(tmp_path / "killed")])
    a, b = final_weights(tmp_path / "reference"), final_weights(tmp_path / "killed")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_sigterm_saves_at_the_next_step_and_exits_0(tmp_path):
    process = start("gan", tmp_path / "run")
    wait_for_checkpoint(tmp_path / "run", process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=HANG)
    assert process.returncode == 0, stderr
    assert "Stopped by SIGTERM at step" in stdout
    step = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["step"]
    assert 0 < step < 200 and f"at step {step};" in stdout
    assert not (tmp_path / "run" / "summary.json").exists()  # stopped, not finished
    run(["-m", "gan.train", *WORKLOADS["gan"], "--resume", str(tmp_path / "run")])
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["step"] == 200


@pytest.mark.parametrize("log_every", [1, 1000])
def test_non_finite_loss_stops_without_overwriting_the_last_good_checkpoint(tmp_path, monkeypatch, log_every):
    """A model that starts returning NaN at its 6th call: the loss check (log_every=1) or the weight check
    before the next checkpoint (log_every=1000) stops the run; the step-4 checkpoint stays intact."""
    from autoencoder import train
    from autoencoder.config import Config
    from autoencoder.model import AutoEncoder
    from common.config import merge
    from core.cli import FabricFlags

    calls = {"n": 0}
    forward = AutoEncoder.forward

    def poisoned(self, images):
        calls["n"] += 1
        out = forward(self, images)
        return out * float("nan") if calls["n"] > 5 else out

    monkeypatch.setattr(AutoEncoder, "forward", poisoned)
    config = merge(Config, FabricFlags)(dataset="fake", batch_size=8, width=4, max_steps=20, log_every=log_every,
                                        checkpoint_every=4, out=str(tmp_path), accelerator="cpu")
    with pytest.raises(FloatingPointError, match="not finite at step 5|non-finite weights after step 8"):
        train.main(config)
    state = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert state["step"] == 4
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_diverged_run_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    result = run(["-m", "autoencoder.train", "--dataset", "fake", "--width", "4", "--max-steps", "5",
                  "--log-every", "1", "--lr-encoder", "1e30", "--lr-decoder", "1e30", "--out", str(tmp_path)],
                 check=False)
    # Adam moves each weight by about lr per step, so weights of 1e30 overflow float32 in the next forward:
    # the run diverges right after its first update on any machine; an exit 0 means the loss check let it through
    assert result.returncode == 1, result.stderr
    assert_whole_line(result.stderr, "python -m autoencoder.train: stopped: the loss is not finite at step")
    assert "Traceback" not in result.stderr and "No checkpoint had been written yet" in result.stderr


def test_same_command_twice_gives_bitwise_identical_weights(tmp_path):
    args = ["-m", "metalearn.train", "--hidden", "16", "--eval-tasks", "10", "--max-steps", "50"]
    run([*args, "--out", str(tmp_path / "a")])
    run([*args, "--out", str(tmp_path / "b")])
    assert_bitwise_equal(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"))


# --- bad input: exit 2 and one line from the command line ---------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    def build(out):
        run(["-m", "gan.train", *WORKLOADS["gan"][:-4], "--max-steps", "4", "--out", str(out)])
    return built_once(tmp_path_factory, "finished-gan", build)  # once for the session's workers; only read


def cli_error(args, tmp_path) -> str:
    result = run(["-m", "gan.train", *WORKLOADS["gan"][:-4], "--max-steps", "8", *args], check=False, timeout=HANG)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m gan.train: error:"), result.stderr
    return lines[0]


def test_resume_with_incompatible_config_names_the_fields(finished_run, tmp_path):
    message = cli_error(["--resume", str(finished_run), "--ngf", "16", "--lr", "0.1"], tmp_path)
    assert "ngf (checkpoint 8, now 16)" in message and "lr (checkpoint 0.0002, now 0.1)" in message


def test_a_checkpoint_of_another_workload_names_it(finished_run, tmp_path):
    result = run(["-m", "autoencoder.train", "--resume", str(finished_run), "--out", str(tmp_path / "new")],
                 check=False, timeout=HANG)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"python -m autoencoder.train: error: --resume {finished_run / 'checkpoints' / 'last.ckpt'}: a checkpoint of "
        f"the gan workload; resume it with python -m gan.train (or gan.train_torch)"]
    assert not (tmp_path / "new").exists()


def test_checkpoint_of_another_model_shape_names_the_keys(finished_run, tmp_path):
    copy = tmp_path / "copied.ckpt"  # outside its run directory: no config.json to compare with
    copy.write_bytes((finished_run / "checkpoints" / "last.ckpt").read_bytes())
    message = cli_error(["--resume", str(copy), "--ngf", "16", "--out", str(tmp_path / "new")], tmp_path)
    assert "does not match the model" in message and "main.0.weight: checkpoint (16, 32, 4, 4)" in message


@pytest.mark.parametrize("kind", ["truncated", "corrupt", "foreign", "malicious", "missing"])
def test_bad_checkpoints_are_refused(finished_run, tmp_path, kind):
    path, marker = tmp_path / "bad.ckpt", tmp_path / "pwned"
    good = (finished_run / "checkpoints" / "last.ckpt").read_bytes()
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "corrupt":
        path.write_bytes(bytes(b ^ 0x5A for b in good[:4096]) + good[4096:])
    elif kind == "foreign":
        torch.save({"generator": {}, "weights": torch.zeros(2)}, path)
    elif kind == "malicious":
        class Exploit:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))
        path.write_bytes(pickle.dumps({"format": "core-checkpoint", "state": Exploit()}))
    message = cli_error(["--resume", str(path), "--out", str(tmp_path / "new")], tmp_path)
    expected = {"truncated": "truncated or corrupt", "corrupt": "truncated or corrupt",
                "foreign": "has no ['discriminator'", "malicious": "refused without running any of it",
                "missing": "no checkpoint at"}[kind]
    assert expected in message and "Please file an issue" not in message  # torch's advice is not for this case
    assert not marker.exists()


def test_empty_data_root(tmp_path):
    (tmp_path / "empty").mkdir()
    message = cli_error(["--dataset", "folder", "--data-root", str(tmp_path / "empty"), "--out", str(tmp_path / "r")],
                        tmp_path)
    assert "dataset 'folder' not found under" in message and "one sub-folder per class" in message


@pytest.mark.parametrize("where", ["under a file", "under /sys"])
def test_output_directory_that_cannot_be_written(tmp_path, where):
    """One line and exit 2 before anything runs, as root too (os.access says yes to root for /sys, where mkdir
    is refused)."""
    if where == "under /sys" and not os.path.isdir("/sys"):
        pytest.skip("no /sys on this system")
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run" if where == "under a file" else Path("/sys/suite-run")
    message = cli_error(["--out", str(out)], tmp_path)
    assert f"cannot write to the run directory {out}" in message and "pass a writable --out" in message


def test_an_output_directory_the_system_refuses_to_look_at_is_one_line(tmp_path, capsys):
    """A name longer than the filesystem allows: stat raises before any check could ask (exit 2, one line)."""
    from common.config import parse
    from gan.config import Config
    with pytest.raises(SystemExit) as exit:
        parse(Config, ["--out", str(tmp_path / ("x" * 300))], prog="python -m gan.train")
    lines = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and "(file name too long); pass another --out" in lines[0], lines
