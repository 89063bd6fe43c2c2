"""The GPU check behind benchmarks/gpu_check.sh: for each workload, strategy and precision, a short run of
the wrapped script on one CUDA device (strategies that shard run as 1 process), with its step time and
the CUDA allocator's peak memory. Strategies or precisions that fail are listed with their error."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.record import ROOT, table, write
from benchmarks.workloads import WORKLOADS, flags

STRATEGIES = ["single", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
ARGS = {name: flags(workload.gpu) for name, workload in WORKLOADS.items()}


def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device is visible to torch")
    rows, started = [], time.time()
    for workload, args in ARGS.items():
        for strategy in STRATEGIES:
            for precision in PRECISIONS:
                if strategy.startswith("deepspeed") and not WORKLOADS[workload].deepspeed:
                    continue  # refused by design, see the workload's README
                with tempfile.TemporaryDirectory() as out:
                    command = [sys.executable, "-m", f"{workload}.train", *args, "--accelerator", "cuda",
                               "--strategy", strategy, "--devices", "1", "--precision", precision, "--out", out]
                    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                                            env={**os.environ, "PYTHONPATH": str(ROOT)})
                    if result.returncode != 0:
                        error = (result.stderr.strip().splitlines() or ["?"])[-1][:120]
                        rows.append([workload, strategy, precision, "failed", "", error])
                    else:
                        records = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
                        step_ms = 1000 * (records[-1]["time"] - records[1]["time"]) / (
                            records[-1]["step"] - records[1]["step"])
                        summary = json.loads((Path(out) / "summary.json").read_text())
                        rows.append([workload, strategy, precision, round(step_ms, 2), summary.get("peak_cuda_mb"),
                                     "ok"])
                print(rows[-1], flush=True)
    markdown = (f"GPU check on {torch.cuda.get_device_name(0)}, one device ({time.time() - started:.0f} s):\n\n" +
                table(["workload", "strategy", "precision", "ms/step", "peak CUDA MB", "status"], rows))
    write("gpu_check", {"args": ARGS}, [dict(zip(["workload", "strategy", "precision", "ms", "mb", "status"], r))
                                         for r in rows], markdown)
    print(markdown)


if __name__ == "__main__":
    main()
