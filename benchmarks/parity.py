"""Wrapped vs plain parity per workload, strategy and precision: final weights, step time, peak memory.

Each comparison runs the real scripts as paired runs with the same seed and config, each pair in an order
drawn at random (seeded by the case, and recorded), so that neither variant always runs first on a machine
that warms up or slows down. An A/A comparison (`against="plain"`: plain vs plain) measures what identical
code differs by here: the noise floor that a wrapped/plain ratio must be read against. Step time is read
from `metrics.jsonl` (every record is stamped with the clock and rank 0's CPU time): the time per step of each
logging window after the first (warm-up) one, median over windows, so start-up, data loading, evaluation and the
final score are not timed. Both clocks are kept; the verdict reads CPU time, which does not count the time
another process holds the core, as the clock does (on an idle machine the two agree; benchmarks/README.md).
Peak memory is the `peak_rss_mb` (CPU) or `peak_cuda_mb` (GPU) of rank 0 in `summary.json`.

The plain side (`plain_reference`) runs what the wrapped side runs, where plain PyTorch has it: the plain script
on one device for `single`, under torchrun (DDP) for `ddp`, and for `fsdp` the workload's plain FSDP2 loop
(`benchmarks/plain_fsdp.py`, under torchrun), so those ratios are the wrapper's own cost. Where there is no plain
counterpart (`deepspeed*`, and `fsdp` of a workload without a plain FSDP2 loop: metalearn) the plain side is
plain DDP: the same math, so weights agree to float tolerance and the time ratio is the strategy's cost.
"""
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.plain_fsdp import WORKLOADS as PLAIN_FSDP
from benchmarks.record import ROOT, spread
from benchmarks.workloads import WORKLOADS, flags


def _command(workload: str, variant: str, strategy: str, precision: str, steps: int, log_every: int, out: Path):
    args = [*flags(WORKLOADS[workload].parity), "--max-steps", str(steps), "--log-every", str(log_every),
            "--out", str(out)]
    if variant == "plain":
        if strategy == "single":
            return [sys.executable, "-m", f"{workload}.train_torch", *args]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m"]
        if strategy == "fsdp":
            return [*torchrun, "benchmarks.plain_fsdp", workload, *args]
        return [*torchrun, f"{workload}.train_torch", *args]
    devices = "1" if strategy == "single" else "2"
    return [sys.executable, "-m", f"{workload}.train", *args, "--strategy", strategy, "--devices", devices,
            "--precision", precision]


def _run(command, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    windows = list(zip(records[1:], records[2:]))

    def per_step(key):
        return [1000 * (b[key] - a[key]) / (b["step"] - a["step"]) for a, b in windows]
    return {"step_ms": per_step("time"), "cpu_ms": per_step("cpu"),
            "memory_mb": summary.get("peak_cuda_mb", summary["peak_rss_mb"])}


def run_weights(run_dir: Path) -> dict:
    """Every floating-point tensor of the models in a run's last checkpoint, by "<key>.<name>", in float32:
    any checkpoint the plain or the wrapped scripts write, read whole by core.checkpoint.read (a sharded
    directory joined, a DeepSpeed one merged from its ZeRO partitions)."""
    from core.checkpoint import read
    state = read(Path(run_dir) / "checkpoints" / "last.ckpt")
    return {f"{key}.{name}": value.float() for key, sub in state.items() if isinstance(sub, dict)
            for name, value in sub.items() if isinstance(value, torch.Tensor) and value.is_floating_point()}


def plain_reference(workload: str, strategy: str) -> str:
    """What the plain side of a `strategy` row runs: "single", "ddp" (the plain script under torchrun) or "fsdp"
    (benchmarks/plain_fsdp.py)."""
    if strategy == "single":
        return "single"
    return "fsdp" if strategy == "fsdp" and workload in PLAIN_FSDP else "ddp"


def compare(workload: str, strategy: str, precision: str = "32-true", repeats: int = 2, scale: int = 1,
            against: str = "wrapped", seed: int = 0) -> dict:
    """Plain vs `against` ("wrapped", or "plain" for the A/A row) over `repeats` pairs, each pair in a random
    order drawn from `seed` and the case; the orders are returned under "orders"."""
    steps, log_every = WORKLOADS[workload].parity_steps
    steps *= scale
    plain_strategy = plain_reference(workload, strategy)
    times = {"plain": [], "wrapped": []}
    cpu = {"plain": [], "wrapped": []}
    memory = {"plain": [], "wrapped": []}
    ratios, cpu_ratios, final, orders = [], [], {}, []
    shuffle = random.Random(f"{seed} {workload} {strategy} {precision} {against}").shuffle
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            medians, cpu_medians = {}, {}
            order = ["plain", "wrapped"]  # "wrapped" is the second side: the wrapped script, or plain again (A/A)
            shuffle(order)
            orders.append(order)
            for variant in order:
                out = Path(tmp) / f"{variant}{repeat}"
                script = "plain" if variant == "plain" or against == "plain" else "wrapped"
                command = _command(workload, script, plain_strategy if script == "plain" else strategy, precision,
                                   steps, log_every, out)
                result = _run(command, out)
                times[variant] += result["step_ms"]
                cpu[variant] += result["cpu_ms"]
                memory[variant].append(result["memory_mb"])
                medians[variant] = statistics.median(result["step_ms"])
                cpu_medians[variant] = statistics.median(result["cpu_ms"])
                if repeat == repeats - 1:
                    final[variant] = run_weights(out)
                else:
                    shutil.rmtree(out, ignore_errors=True)
            ratios.append(medians["wrapped"] / medians["plain"])
            cpu_ratios.append(cpu_medians["wrapped"] / cpu_medians["plain"])
    a, b = final["plain"], final["wrapped"]
    common = [key for key in a if key in b and a[key].shape == b[key].shape]
    difference = max((a[k] - b[k]).abs().max().item() for k in common) if common else float("nan")
    bitwise = bool(common) and len(common) == len(a) and all(torch.equal(a[k], b[k]) for k in common)
    return {"workload": workload, "strategy": strategy, "precision": precision, "steps": steps, "against": against,
            "plain": plain_strategy,
            "orders": orders,
            "plain_ms": spread(times["plain"]), "wrapped_ms": spread(times["wrapped"]), "ratio": spread(ratios),
            "plain_cpu_ms": spread(cpu["plain"]), "wrapped_cpu_ms": spread(cpu["wrapped"]),
            "cpu_ratio": spread(cpu_ratios),
            "plain_memory_mb": statistics.median(memory["plain"]),
            "wrapped_memory_mb": statistics.median(memory["wrapped"]),
            "weights_bitwise_equal": bitwise, "weights_max_abs_diff": difference, "compared_tensors": len(common)}
