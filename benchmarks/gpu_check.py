"""The GPU check: plain against wrapped on CUDA, for a session that has a GPU for a few minutes.

    bash benchmarks/gpu_check.sh                 # or: python -m benchmarks.gpu_check [--budget-s 540]

For each workload (its `gpu` settings in benchmarks/workloads.py), on one device: the plain script, then
the wrapped one under single in every precision, and under fsdp, deepspeed_stage_2 and deepspeed_stage_3
in 32-true and bf16-mixed; on N devices (N = the GPUs torch sees, when 2 or more): plain DDP under torchrun
against ddp and fsdp. Each row gives the step time (median over logging windows after the first), the CUDA
allocator's peak memory of rank 0, both against the plain run of the same device count, and the largest
difference of any final weight from it (0 = bitwise; precisions and sharded optimizers differ by design).

A run that exits 2 with one line (the scripts' CLI refusing a combination: metalearn under DeepSpeed,
16-mixed under fsdp, bf16 on a GPU without native bfloat16) is listed as refused, apart from failures
(any other exit). The check stops starting runs when its time budget is spent and lists the rest as not
run, and it rewrites its results file after every row, so that a session that ends early keeps the rows
done: benchmarks/results/gpu_check.md and .json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.parity import run_weights
from benchmarks.record import ROOT, table, write
from benchmarks.workloads import WORKLOADS, flags

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SHARDED = ["fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]
COLUMNS = ["workload", "devices", "variant", "precision", "ms/step", "ratio", "peak CUDA MB", "memory ratio",
           "weights max diff", "status"]


def cases(devices: int) -> list[tuple]:
    """(workload, devices, variant, precision); variant "plain" or a strategy of the wrapped script."""
    out = []
    for workload in WORKLOADS:
        out.append((workload, 1, "plain", "32-true"))
        out += [(workload, 1, "single", precision) for precision in PRECISIONS]
        out += [(workload, 1, strategy, precision) for strategy in SHARDED for precision in ("32-true", "bf16-mixed")]
        out.append((workload, 1, "fsdp", "16-mixed"))  # refused: FSDP2 has no loss scaler here
        if devices >= 2:
            out += [(workload, devices, "plain", "32-true"), (workload, devices, "ddp", "32-true"),
                    (workload, devices, "fsdp", "32-true")]
    return out


def command(workload: str, devices: int, variant: str, precision: str, out: Path) -> list[str]:
    args = [*flags(WORKLOADS[workload].gpu), "--out", str(out)]
    if variant == "plain":
        if devices == 1:
            return [sys.executable, "-m", f"{workload}.train_torch", *args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices),
                "-m", f"{workload}.train_torch", *args]
    return [sys.executable, "-m", f"{workload}.train", *args, "--accelerator", "cuda", "--strategy", variant,
            "--devices", str(devices), "--precision", precision]


def run_case(case: tuple, out: Path, timeout: float) -> dict:
    """One run: its status ("ok", "refused: ...", "failed: ..."), step time, peak memory and weights."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        result = subprocess.run(command(*case, out), cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: still running after {timeout:.0f} s"}
    last = (result.stderr.strip().splitlines() or ["(no output)"])[-1][:160]
    if result.returncode == 2 and "Traceback" not in result.stderr:
        return {"status": f"refused: {last}"}
    if result.returncode != 0:
        return {"status": f"failed (exit {result.returncode}): {last}"}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = [1000 * (b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(records[1:], records[2:])]
    summary = json.loads((out / "summary.json").read_text())
    return {"status": "ok", "step_ms": statistics.median(per_step) if per_step else None,
            "peak_cuda_mb": summary.get("peak_cuda_mb"), "weights": run_weights(out)}


def max_difference(a: dict, b: dict) -> float | None:
    common = [k for k in a if k in b and a[k].shape == b[k].shape]
    return max((a[k] - b[k]).abs().max().item() for k in common) if common else None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting runs after this many seconds "
                        "(default 540: the check ends inside 10 minutes on one GPU)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; run it on a machine with a GPU (torch "
                 f"{torch.__version__}, {'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'})")
    devices, started = torch.cuda.device_count(), time.monotonic()
    rows, plain = [], {}
    for case in cases(devices):
        workload, n, variant, precision = case
        left = args.budget_s - (time.monotonic() - started)
        if left < 20:
            result = {"status": "not run: time budget spent"}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                result = run_case(case, Path(tmp) / "run", timeout=min(240, left))
        reference = plain.get((workload, n)) if variant != "plain" else None
        if variant == "plain" and result["status"] == "ok":
            plain[(workload, n)] = result
        ok = result["status"] == "ok"
        ratio = result["step_ms"] / reference["step_ms"] if ok and reference and reference["step_ms"] else None
        memory = (result["peak_cuda_mb"] / reference["peak_cuda_mb"]
                  if ok and reference and reference["peak_cuda_mb"] and result["peak_cuda_mb"] else None)
        difference = max_difference(result["weights"], reference["weights"]) if ok and reference else None
        rows.append({"workload": workload, "devices": n, "variant": variant, "precision": precision,
                     "step_ms": result.get("step_ms"), "ratio": ratio, "peak_cuda_mb": result.get("peak_cuda_mb"),
                     "memory_ratio": memory, "weights_max_abs_diff": difference, "status": result["status"]})
        print(json.dumps(rows[-1]), flush=True)
        report(rows, torch.cuda.get_device_name(0), devices, time.monotonic() - started, args.budget_s)
    print(report(rows, torch.cuda.get_device_name(0), devices, time.monotonic() - started, args.budget_s))


def report(rows: list[dict], gpu: str, devices: int, seconds: float, budget: float) -> str:
    """The results file, rewritten after each row: ran, refused, failed and not-run rows in tables apart."""
    def cell(value, digits=4):
        return "" if value is None else round(value, digits) if isinstance(value, float) else value

    groups = {"ok": [], "refused": [], "failed": [], "not run": []}
    for r in rows:
        kind = next(k for k in groups if r["status"].startswith(k))
        groups[kind].append([r["workload"], r["devices"], r["variant"], r["precision"], cell(r["step_ms"], 2),
                             cell(r["ratio"], 3), cell(r["peak_cuda_mb"], 1), cell(r["memory_ratio"], 3),
                             cell(r["weights_max_abs_diff"], 9), r["status"]])
    markdown = (f"GPU check on {gpu} ({devices} visible), {seconds:.0f} s of a "
                f"{budget:.0f} s budget. Ratios and weight differences are against the plain script on the same "
                "number of devices (plain DDP under torchrun on N).\n\n")
    titles = {"ok": "Ran", "refused": "Refused by design (exit 2, one line)", "failed": "Failed",
              "not run": "Not run (time budget)"}
    for kind, lines in groups.items():
        markdown += f"**{titles[kind]}: {len(lines)}**\n\n" + (table(COLUMNS, lines) + "\n" if lines else "")
    write("gpu_check", {"budget_s": budget, "devices": devices,
                        "settings": {name: w.gpu for name, w in WORKLOADS.items()}}, rows, markdown,
          threads="OMP_NUM_THREADS from the environment")
    return markdown


if __name__ == "__main__":
    main()
