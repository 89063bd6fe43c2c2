"""Result files: every result records the commit, the config, the library versions and the machine."""
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"  # full runs; quick runs write to RESULTS / "quick"
ROOT = Path(__file__).resolve().parent.parent


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        # the results and the tables in benchmarks/README.md are this harness's own output, rewritten as it goes
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                     ":!benchmarks/results", ":!benchmarks/README.md"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    try:
        import deepspeed
        deepspeed_version = deepspeed.__version__
    except ImportError:
        deepspeed_version = None
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"commit": commit + ("-dirty" if dirty else ""), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed_version,
            "cpu": cpu, "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def uncommitted() -> bool:
    """True when the code differs from its commit (outside the results and benchmarks/README.md, which this harness
    writes): a full run's figures, which are committed, must come from code a commit holds."""
    return environment()["commit"].endswith("-dirty")


def part_main(prog: str, description: str, run, argv=None) -> None:
    """The command line of one part run alone (`python -m benchmarks.cadence [--quick]`): `run(quick)` returns
    its markdown; a full run from uncommitted code is refused, since its results are committed."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats; writes results/quick/")
    args = parser.parse_args(argv)
    if not args.quick and uncommitted():
        parser.error("a full run writes the committed results, which must come from a commit: commit (or stash) "
                     "the changes first, or pass --quick")
    print(run(args.quick))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def results_dir(quick: bool) -> Path:
    """Where a run writes: quick runs beside the committed full results, never over them."""
    return RESULTS / "quick" if quick else RESULTS


def write(name: str, config: dict, rows: list[dict], markdown: str, threads: int | str = 1,
          quick: bool = False) -> Path:
    """Write <name>.json and <name>.md into results_dir(quick); return the markdown path. `threads`: the
    intra-op threads of each timed process (the parts pin 1; the quality runs keep torch's default)."""
    directory = results_dir(quick)
    directory.mkdir(parents=True, exist_ok=True)
    env = {**environment(), "threads_per_process": threads}
    (directory / f"{name}.json").write_text(json.dumps({"environment": env, "config": config, "rows": rows},
                                                     indent=2) + "\n")
    header = (f"_commit {env['commit']}, {env['date']}, torch {env['torch']}, deepspeed {env['deepspeed']}, "
              f"{env['cpu']} ({env['cores']} cores), "
              f"{threads if isinstance(threads, str) else f'{threads} thread(s)'} per process"
              f"{', ' + env['gpu'] if env['gpu'] else ''}; config: `{json.dumps(config)}`_\n\n")
    path = directory / f"{name}.md"
    path.write_text(header + markdown)
    return path


def table(columns: list[str], rows: list[list]) -> str:
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def bar_chart(path: Path, labels: list[str], values: list[float], target, xlabel: str) -> None:
    """Horizontal bars; `target`: None, one bound for all bars (a dashed line), or one bound (or None) per bar
    (a tick on each bar). A bar above its bound is red."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = target if isinstance(target, list) else [target] * len(values)
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(labels) + 1.2))
    ax.barh(labels, values, color=["tab:red" if t and v > t else "tab:blue" for v, t in zip(values, targets)])
    if isinstance(target, list):
        marked = [(i, t) for i, t in enumerate(targets) if t]
        ax.plot([t for _, t in marked], [i for i, _ in marked], "k|", markersize=14, label="target")
    elif target:
        ax.axvline(target, color="k", linestyle="--", label=f"target {target}")
    if any(targets):
        ax.legend()
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
