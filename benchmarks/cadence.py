"""What the default checkpoint cadence (`--checkpoint-every 500`) costs each workload's default command.

    python -m benchmarks.cadence            # writes benchmarks/results/cadence.{json,md}
    python -m benchmarks.cadence --quick    # fewer steps and repeats, into benchmarks/results/quick/

One save is too short to time against a whole run's noise, so each repeat runs the default command twice for
S steps, saving after every step (`--checkpoint-every 1`) and only at the end (`0`): the difference of the
two runs' clocks at step S (metrics.jsonl's `time`), over the S - 1 saves before it, is one save's cost. A
step's time comes from the second run, between its records at steps S and 2S. The cost of the cadence is one
save per 500 steps: save / (500 x step). Medians over the repeats; each run is the user's command, default
data and flags.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.record import ROOT, part_main, table, write
from benchmarks.workloads import WORKLOADS

CADENCE = 500  # common/config.py's default --checkpoint-every
TARGET = 0.02  # the default run may get at most 2% slower (issue 27)


def clock_at(out: Path, step: int) -> float:
    """Seconds since the run started, at the record of `step`."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["time"] for r in records if r["step"] == step)


def measure(workload: str, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        outs = {every: Path(tmp) / f"every{every}" for every in (1, 0)}
        for every, out in outs.items():
            total = steps if every else 2 * steps
            subprocess.run([sys.executable, "-m", f"{workload}.train", "--accelerator", "cpu", "--max-steps",
                            str(total), "--log-every", str(steps), "--checkpoint-every", str(every), "--out",
                            str(out)], cwd=ROOT, env=env, check=True, capture_output=True)
        save = (clock_at(outs[1], steps) - clock_at(outs[0], steps)) / (steps - 1)  # saved after steps 1..S-1
        step = (clock_at(outs[0], 2 * steps) - clock_at(outs[0], steps)) / steps
    return {"save_s": save, "step_s": step}


def main(argv=None):
    part_main("python -m benchmarks.cadence", __doc__, run_cadence, argv)


def run_cadence(quick: bool) -> str:
    steps, repeats = (50, 1) if quick else (200, 3)
    rows, records = [], []
    for name in WORKLOADS:
        runs = [measure(name, steps) for _ in range(repeats)]
        save, step = (statistics.median(r[key] for r in runs) for key in ("save_s", "step_s"))
        cost = max(save, 0.0) / (CADENCE * step)
        records.append({"workload": name, "runs": runs, "save_s": save, "step_s": step, "cost": cost})
        rows.append([name, round(save * 1000, 2), round(step * 1000, 2), f"{cost:.3%}",
                     "yes" if cost <= TARGET else "**no**"])
    markdown = (f"The default command of each workload (default data and flags, 1 thread), {steps} steps with a save "
                f"after each against {steps} without: one save's cost, and one step's; median of {repeats}. Cost of "
                f"the default cadence: one save per {CADENCE} steps. Target: at most {TARGET:.0%}.\n\n"
                + table(["workload", "save ms", "step ms", f"cost at --checkpoint-every {CADENCE}", "met"], rows))
    write("cadence", {"steps": steps, "repeats": repeats, "cadence": CADENCE}, records, markdown, quick=quick)
    return markdown


if __name__ == "__main__":
    main()
