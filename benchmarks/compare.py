"""Run the plain and the wrapped variant of one workload with the same seed and config, and show them
side by side: final metrics, weight difference, and one plot with both loss curves.

    python -m benchmarks.compare gan                  # short runs on the embedded data
    python -m benchmarks.compare metalearn --max-steps 2000
    python -m benchmarks.compare autoencoder --strategy ddp --devices 2   # wrapped side under DDP
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.parity import run_weights
from benchmarks.record import RESULTS, ROOT
from benchmarks.workloads import WORKLOADS


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--max-steps", type=int, help="steps of both runs (default: a short run per workload)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both runs")
    parser.add_argument("--strategy", default="single", help="the wrapped run's strategy")
    parser.add_argument("--devices", default="1", help="the wrapped run's processes")
    parser.add_argument("--out", default=str(RESULTS / "compare"), help="folder for both runs and the plot")
    args = parser.parse_args(argv)
    steps = args.max_steps or WORKLOADS[args.workload].compare_steps
    out = Path(args.out) / args.workload
    common = ["--max-steps", str(steps), "--seed", str(args.seed), "--log-every", str(max(1, steps // 30))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {"plain": [sys.executable, "-m", f"{args.workload}.train_torch", *common, "--out", str(out / "plain")],
            "wrapped": [sys.executable, "-m", f"{args.workload}.train", *common, "--strategy", args.strategy,
                        "--devices", args.devices, "--out", str(out / "wrapped")]}
    summaries, metrics = {}, {}
    if out.exists():  # both runs of an earlier comparison: removed only in the default place, which is ours
        if not out.resolve().is_relative_to((RESULTS / "compare").resolve()):
            parser.error(f"{out} holds an earlier comparison; remove it or pass another --out")
        shutil.rmtree(out)
    for name, command in runs.items():
        print(f"{name}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, cwd=ROOT, env=env, check=True)
        summaries[name] = json.loads((out / name / "summary.json").read_text())
        metrics[name] = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]

    keys = [k for k, v in summaries["plain"].items() if isinstance(v, (int, float)) and k in summaries["wrapped"]]
    keys += [k for k, v in summaries["plain"].items() if isinstance(v, dict) and k != "config"]
    print(f"\n{'metric':28} {'plain':>16} {'wrapped':>16}")
    for key in keys:
        a, b = summaries["plain"][key], summaries["wrapped"].get(key)
        if isinstance(a, dict):
            for sub in a:
                print(f"{key + '[' + sub + ']':28} {a[sub]:>16.6g} {b[sub]:>16.6g}")
        else:
            print(f"{key:28} {a:>16.6g} {b:>16.6g}")
    plain, wrapped = run_weights(out / "plain"), run_weights(out / "wrapped")
    difference = max((plain[k] - wrapped[k]).abs().max().item() for k in plain)
    print(f"{'weights max abs difference':28} {difference:>16.3g}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("plain", "-"), ("wrapped", "--")):
        for key in WORKLOADS[args.workload].losses:
            ax.plot([r["step"] for r in metrics[name]], [r[key] for r in metrics[name]], style, label=f"{name} {key}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=100)
    print(f"\nloss curves: {out / 'losses.png'}")


if __name__ == "__main__":
    main()
