"""Result files: every result records the commit, the config, the library versions and the machine."""
import importlib.metadata
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
    try:  # the installed version, without importing it (its import probes for accelerators and logs that)
        deepspeed_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
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


def paste_into_readme(name: str) -> None:
    """Put results/<name>.md between `<!-- name -->` and `<!-- /name -->` in benchmarks/README.md: the parts that
    also run alone (machine, cadence, evaluation) have their section there, outside the tables run.py writes."""
    readme = ROOT / "benchmarks" / "README.md"
    text = readme.read_text()
    start, end = f"<!-- {name} -->\n", f"<!-- /{name} -->\n"
    i, j = text.index(start) + len(start), text.index(end)
    readme.write_text(text[:i] + (RESULTS / f"{name}.md").read_text().strip() + "\n" + text[j:])


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
    if not args.quick:
        name = prog.rsplit(".", 1)[-1]
        paste_into_readme(name)
        print(f"Written: {RESULTS / (name + '.md')}, and its section in benchmarks/README.md")


def best_seconds(call, seconds: float = 0.1) -> float:
    """One call's best time: a loop sized to about seconds / 5, timed 5 times, the fastest per call."""
    call()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds / 5:
        call()
        count += 1
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(count):
            call()
        best = min(best, (time.perf_counter() - start) / count)
    return best


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


def ratio_chart(path: Path, labels: list[str], spreads: list[dict], floors: list[float | None], xlabel: str,
                title: str, target: float | None = None, spread: str = "median [min-max]",
                targets: list[float | None] | None = None) -> None:
    """One row per label: the ratio as a point (`median`), its spread or interval (`min`, `max`) as a line through
    it, and the noise band 1 +- floor (None: no band) shaded behind it, around a line at 1.0 (no difference);
    `target`: a dashed line where every ratio must stay under; `targets`: each row's own, as a red bar on its row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.42 * len(labels) + 1.6))
    banded = False
    for y, floor in enumerate(floors):
        if floor is not None:
            ax.fill_betweenx([y - 0.4, y + 0.4], 1 - floor, 1 + floor, color="0.85", lw=0,
                             label=None if banded else "noise band (A/A)")
            banded = True
    medians = [s["median"] for s in spreads]
    ax.errorbar(medians, range(len(labels)), xerr=[[m - s["min"] for m, s in zip(medians, spreads)],
                                                   [s["max"] - m for m, s in zip(medians, spreads)]],
                fmt="o", color="tab:blue", ecolor="tab:blue", capsize=3, label=spread)
    ax.axvline(1.0, color="k", lw=0.8)
    if target is not None:
        ax.axvline(target, color="tab:red", lw=1, ls="--", label=f"target {target:g}")
    marked = [(t, y) for y, t in enumerate(targets or []) if t is not None]
    if marked:
        ax.plot([t for t, _ in marked], [y for _, y in marked], "|", color="tab:red", markersize=14, mew=2,
                label="the row's target")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    below = 0.6 / (0.42 * len(labels) + 0.6)  # under the x label: about 0.6 inch, in the axes' height
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -below), ncol=3, frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
