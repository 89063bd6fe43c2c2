"""The training options the autoencoder and MAML share (--accumulate, --lr-schedule, --compile, the throughput
records), each against a reference: N micro-batches against one batch N times larger (SGD in core, so a
scaled gradient shows; the workloads' own Adam runs too), the schedule against its formula and across a
resume, a compiled run against an eager one."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.parity import run_weights
from common.bookkeeping import Bookkeeping
from common.config import RunConfig
from common.rundir import RunDir
from common.steps import lr_scheduler
from common.stopping import StopRequests
from tests.conftest import HANG, ROOT, TORCHRUN, run
from tests.test_usability import one_line_error

CPU = ["--accelerator", "cpu"]
AUTOENCODER = ["-m", "autoencoder.train", "--width", "4", "--log-every", "3", *CPU]
METALEARN = ["-m", "metalearn.train", "--hidden", "16", "--eval-tasks", "10", "--log-every", "3", *CPU]


def losses(run_dir) -> list[float]:
    return [record["loss"] for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def assert_same_training(a, b, atol=1e-6, compare_losses=True):
    """Two runs' final weights (and logged losses: rank 0's own, so only between runs of one process) agree
    to float rounding."""
    if compare_losses:
        assert losses(a) == pytest.approx(losses(b), rel=1e-5, abs=1e-7)
    wa, wb = run_weights(a), run_weights(b)
    assert wa.keys() == wb.keys() and wa
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= atol


# --- gradient accumulation -------------------------------------------------------------------------
# Core's part: no_backward_sync under each strategy, with SGD. The ranks' data differ, so a rank that never
# synchronised, synchronised every micro-batch into a doubled sum, or whose engine stepped early, ends with
# other weights than one process taking both ranks' full batch.
def accumulate(fabric, path: str) -> None:
    """3 SGD steps of 2 micro-batches each, the first under no_backward_sync, the ranks' halves of 8 examples per
    micro-batch; the whole model saved to `path`. A case of the long-lived group (tests/group.py) on 2 ranks."""
    torch.manual_seed(1)
    inputs, targets = torch.randn(3, 2, 8, 6), torch.randn(3, 2, 8, 1)  # (steps, micro-batches, examples, ...)
    mine = slice(fabric.global_rank * 8 // fabric.world_size, (fabric.global_rank + 1) * 8 // fabric.world_size)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for x, y in zip(inputs, targets):
        optimizer.zero_grad()
        for i in range(2):
            with fabric.no_backward_sync(model, enabled=i == 0):
                fabric.backward(((model(x[i, mine]) - y[i, mine]) ** 2).mean() / 2)
        optimizer.step()
    fabric.save(path, {"model": model})


def reference_weights() -> dict:
    """One process, one batch of all 16 examples per step: what every accumulating run must reach."""
    torch.manual_seed(1)
    inputs, targets = torch.randn(3, 2, 8, 6), torch.randn(3, 2, 8, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in zip(inputs, targets):
        optimizer.zero_grad()
        ((model(x.reshape(16, 6)) - y.reshape(16, 1)) ** 2).mean().backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2",
                                      "deepspeed_stage_3"])
def test_micro_batches_under_no_backward_sync_equal_one_larger_batch(tmp_path, two_ranks, strategy):
    """On one process in this one, on two in the session's group of the strategy's family."""
    from core import Fabric
    from core.checkpoint import read

    path = str(tmp_path / "model.ckpt")
    if strategy == "single":
        accumulate(Fabric(accelerator="cpu"), path)
    else:
        if strategy.startswith("deepspeed"):
            pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
        two_ranks(strategy.split("_")[0]).run(accumulate, path, strategy=strategy)
    saved = read(path)["model"]
    expected = reference_weights()
    assert saved.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], rtol=0, atol=1e-6)


def test_accumulating_autoencoder_trains_like_a_batch_twice_as_large(tmp_path):
    """The workload's own loop (Adam, the default digits): micro-batches are consecutive batches of the same
    order, and the logged loss is the step's mean, not the last micro-batch's."""
    run([*AUTOENCODER, "--max-steps", "6", "--batch-size", "16", "--out", str(tmp_path / "one")])
    run([*AUTOENCODER, "--max-steps", "6", "--batch-size", "8", "--accumulate", "2", "--out", str(tmp_path / "two")])
    assert_same_training(tmp_path / "one", tmp_path / "two")


def test_accumulating_maml_meta_batches_equal_one_larger_meta_batch(tmp_path):
    run([*METALEARN, "--max-steps", "6", "--batch-size", "12", "--out", str(tmp_path / "one")])
    run([*METALEARN, "--max-steps", "6", "--batch-size", "4", "--accumulate", "3", "--out", str(tmp_path / "three")])
    assert_same_training(tmp_path / "one", tmp_path / "three")


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["autoencoder", "metalearn"])
def test_accumulation_across_processes_matches_one_process(tmp_path, workload):
    """Plain DDP (no_sync) for the autoencoder, core's fsdp for MAML, each against one process."""
    if workload == "autoencoder":
        common = ["--width", "4", "--log-every", "3", "--max-steps", "6"]
        run(["-m", "autoencoder.train", *common, *CPU, "--batch-size", "32", "--out", str(tmp_path / "one")])
        run([*TORCHRUN, "-m", "autoencoder.train_torch", *common,
             "--batch-size", "8", "--accumulate", "2", "--out", str(tmp_path / "many")], timeout=400)
    else:
        run([*METALEARN, "--max-steps", "6", "--batch-size", "12", "--out", str(tmp_path / "one")])
        run([*METALEARN, "--max-steps", "6", "--batch-size", "6", "--accumulate", "2", "--strategy", "fsdp",
             "--devices", "2", "--out", str(tmp_path / "many")], timeout=400)
    assert_same_training(tmp_path / "one", tmp_path / "many", atol=2e-6, compare_losses=False)


# --- the learning-rate schedule --------------------------------------------------------------------
def test_cosine_schedule_warms_up_linearly_then_decays_to_zero_at_the_last_step():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = lr_scheduler(optimizer, SimpleNamespace(lr_schedule="cosine", warmup_steps=3, max_steps=11))
    rates = []
    for _ in range(11):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [0.1 * (s + 1) / 4 for s in range(3)] + [0.05 * (1 + math.cos(math.pi * s / 8)) for s in range(8)]
    assert rates == pytest.approx(expected)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # after the last step
    constant = lr_scheduler(optimizer, SimpleNamespace(lr_schedule="constant", warmup_steps=0, max_steps=11))
    assert constant.get_last_lr() == [0.1]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train", "train_torch"])
def test_a_cosine_run_stopped_mid_schedule_resumes_exactly_and_refuses_a_new_length(tmp_path, script):
    common = ["-m", f"autoencoder.{script}", "--width", "4", "--batch-size", "8", "--log-every", "5",
              "--max-steps", "150", "--lr-schedule", "cosine", "--warmup-steps", "20"]
    common += CPU if script == "train" else []
    run([*common, "--out", str(tmp_path / "whole")])
    stopped = subprocess.Popen([sys.executable, *common, "--out", str(tmp_path / "parts")], cwd=ROOT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    metrics = tmp_path / "parts" / "metrics.jsonl"
    while not metrics.exists() and stopped.poll() is None:
        time.sleep(0.02)
    stopped.send_signal(signal.SIGTERM)  # saves after the next step, mid-schedule
    assert stopped.wait(timeout=HANG) == 0 and "Stopped by SIGTERM" in stopped.communicate()[0]
    saved = torch.load(tmp_path / "parts" / "checkpoints" / "last.ckpt", weights_only=True)
    at = saved.get("state", saved)["scheduler"]["last_epoch"]
    assert 5 <= at < 150 and not (tmp_path / "parts" / "summary.json").exists()
    longer = ["160" if arg == "150" else arg for arg in common]
    refused = run([*longer, "--resume", str(tmp_path / "parts")], check=False)
    one_line_error(refused, "cannot resume", "max_steps (checkpoint 150, now 160), where the cosine schedule ends")
    run([*common, "--resume", str(tmp_path / "parts")])
    assert_same_training(tmp_path / "whole", tmp_path / "parts", atol=0)


def test_option_misuse_is_one_line(tmp_path):
    one_line_error(run([*AUTOENCODER, "--warmup-steps", "5"], check=False), "--warmup-steps", "--lr-schedule cosine")
    one_line_error(run([*AUTOENCODER, "--accumulate", "0"], check=False), "--accumulate must be >= 1")
    one_line_error(run([*AUTOENCODER, "--lr-schedule", "cosine", "--warmup-steps", "9", "--max-steps", "9"],
                       check=False), "--warmup-steps (9) must be less than --max-steps (9)")
    one_line_error(run(["-m", "gan.train", "--accumulate", "2"], check=False), "--accumulate", "BatchNorm",
                   "raise --batch-size")


# --- throughput ------------------------------------------------------------------------------------
def test_records_carry_examples_per_second_over_the_last_interval(tmp_path, monkeypatch):
    run_dir = RunDir(str(tmp_path / "run"), "test")
    clock = iter([10.0, 10.5, 10.5, 12.5, 12.5])  # the start, then each log step: its throughput, its record
    monkeypatch.setattr("common.bookkeeping.time.perf_counter", lambda: next(clock))
    state = {"step": 0}
    loop = Bookkeeping(RunConfig(max_steps=4, log_every=2), state, run_dir, StopRequests(), "test", 24)
    for step in range(4):
        loop.end_step(step, torch.tensor(1.0), lambda: {"loss": 1.0})
    loop.stop.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["examples_per_s"] for r in records] == [2 * 24 / 0.5, 2 * 24 / 2.0]


# --- torch.compile ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("workload", ["autoencoder", "metalearn"])
def test_a_compiled_run_trains_like_an_eager_one(tmp_path, workload):
    command = AUTOENCODER + ["--batch-size", "8"] if workload == "autoencoder" else METALEARN + ["--queries", "10"]
    run([*command, "--max-steps", "6", "--out", str(tmp_path / "eager")])
    run([*command, "--max-steps", "6", "--compile", "--out", str(tmp_path / "compiled")], timeout=400)
    assert_same_training(tmp_path / "eager", tmp_path / "compiled", atol=1e-5)
