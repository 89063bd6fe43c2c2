"""Calibration of the overhead verdicts: can each row of benchmarks/overhead.py tell a slowdown on this machine?

    python -m benchmarks.calibrate                       # every row, 10 repeats, the full run's rounds
    python -m benchmarks.calibrate --rows 32-true --repeats 3 --quick

Each repeat is one fresh process (`python -m benchmarks.overhead PATH --calibrate --seed S`) that interleaves
four sides in the row's blocks: plain, plain again (the A/A pair), and plain again slowed by a busy-wait of a
known fraction of the plain step at the row's calibration target and at 3x or more of it (overhead.CALIBRATIONS:
3% and 10% for the MLP rows, target 1.03; 1% and 3% for a workload's step, target 1.01; benchmarks/paired.py).
Slowing a copy of plain, rather than the wrapped side, makes the true ratio known whatever the wrapper costs.
Each side's ratio to plain gets the verdict the overhead table uses, against the row's calibration target. What a
row must show: the A/A pair reads "yes" or "no verdict" (never "no") in at least 9 of 10 repeats, and the larger
slowdown reads "no" in at least 9 of 10. Whether it resolves the target: the A/A pair reads "yes" in at least 9 of
10, and the slowdown at the target "yes" in at most 1 of 10. The smallest slowdown a row detects
(paired.detectable): the target's margin plus the 90th percentile, over all its intervals, of how far an
interval's lower end lies below its side's median estimate (interval width and scatter between repeats).
Results: benchmarks/results/calibration.md and .json; `--summarize-again` recomputes them from the stored runs.
"""
import argparse
import json
import statistics
import sys

from benchmarks import overhead, paired
from benchmarks.record import environment, results_dir, table, uncommitted, write

CLOCK = "cpu"  # the clock of most verdicts (overhead.VERDICT_CLOCK: the others); all are recorded
NEEDED = 0.9  # of the repeats: A/A never "no", the larger slowdown "no"


def outcome(verdicts: list[str]) -> dict:
    return {"yes": verdicts.count("yes"), "no": verdicts.count("no"),
            "no verdict": sum(v.startswith("no verdict") for v in verdicts)}


def calibrated_at(sides) -> tuple[float, dict]:
    """(target, {side: slowdown}) of the calibration whose sides `sides` (names) are: a stored row keeps the
    calibration it ran (a workload row calibrated before the 1.01 target has the MLP's sides, at 1.03)."""
    names = [name for name in sides if name != "plain"]
    for target, calibration in overhead.CALIBRATIONS.values():
        if list(calibration) == names:
            return target, calibration
    raise ValueError(f"no calibration in overhead.CALIBRATIONS has the sides {names}")


def summarize_row(path: str, runs: list[dict], clock: str | None = None) -> dict:
    """Counts of each verdict per calibration side, the intervals' noise, and the smallest detectable slowdown."""
    clock = clock or overhead.clock_of(path)
    target, calibration = calibrated_at(runs[0]["ratios"])
    aa, at_target, over = calibration  # the A/A pair, the slowdown at the target, the larger one
    sides, intervals, estimates = {}, [], []
    for side in calibration:
        ratios = [run["ratios"][side][clock] for run in runs]
        verdicts = [paired.verdict(r["interval"], target) for r in ratios]
        intervals += [r["interval"] for r in ratios]
        # the side's reading over the repeats: its intervals' lower ends below it hold both their width and
        # the scatter of the estimates from repeat to repeat
        estimates += [statistics.median(r["ratio"] for r in ratios)] * len(ratios)
        sides[side] = {"verdicts": verdicts, **outcome(verdicts),
                       "ratio_median": statistics.median(r["ratio"] for r in ratios),
                       "spin_alone_median": statistics.median(run["spin_alone"].get(side, 0.0) for run in runs)}
    needed = round(NEEDED * len(runs))  # of 10: 9, counted in whole repeats ((1 - 0.9) * 10 is 0.999...)
    passed = sides[aa]["no"] <= len(runs) - needed and sides[over]["no"] >= needed
    # resolving the target: a wrapper that costs nothing reads yes, one that costs the target's margin does not
    resolves = sides[aa]["yes"] >= needed and sides[at_target]["yes"] <= len(runs) - needed
    return {"path": path, "clock": clock, "repeats": len(runs), "target": target, "sides": sides, "passed": passed,
            "resolves_target": resolves,
            "noise_pct_median": statistics.median(paired.noise(i) for i in intervals),
            "detectable": paired.detectable(intervals, estimates, target)}


def markdown(rows: list[dict], commands: list[str]) -> str:
    lines = []
    for r in rows:
        s = r["sides"]
        target, calibration = calibrated_at(s)
        _, at_target, over = calibration
        counts = [f"{s[side]['yes']} / {s[side]['no']} / {s[side]['no verdict']}" for side in calibration]
        lines.append([r["path"], r.get("commit", ""), r["clock"], f"{target}",
                      ", ".join(f"{calibration[side]:.0%}" for side in (at_target, over)), *counts,
                      f"{s[at_target]['spin_alone_median']:.1%}, {s[over]['spin_alone_median']:.1%}",
                      " / ".join(f"{s[side]['ratio_median']:.3f}" for side in calibration),
                      f"+-{r['noise_pct_median']:.1f}%", f"{r['detectable']:.1%}",
                      "yes" if r["passed"] else "**no**", "yes" if r.get("resolves_target") else "**no**"])
    repeats = sorted({r["repeats"] for r in rows})
    return (f"Calibration of the overhead verdicts ({' or '.join(map(str, repeats))} repeats per row, each a fresh "
            f"process; verdicts on the row's clock: CPU time of the process, of the training thread for ddp; each row "
            f"against its calibration target: 1.03 for the MLP, tighter than its 1.05, and 1.01 for a workload's step): "
            f"each repeat interleaves plain, plain again (A/A), and plain again slowed by a busy-wait at the target "
            f"and at 3x or more of it (slowdowns: 3% and 10% of the plain step for the MLP, 1% and 3% for a workload's "
            f"step), in the row's own blocks and rounds. Counts are yes / no / no verdict. A row passes when the A/A "
            f"pair reads no in at most {1 - NEEDED:.0%} of repeats and the larger slowdown reads no in at least "
            f"{NEEDED:.0%}. The busy-wait is sized after the warm-up; busy-wait alone: it timed again alone after the "
            f"rounds, against the rounds' own plain step (median over repeats); ratio read: the median estimate of "
            f"each side, which is what the slowdown came to inside the steps. Noise: the median interval half-width. "
            f"Smallest detectable: the slowdown that would read no in 9 of 10 repeats (the target's margin plus the "
            f"90th percentile of how far an interval's lower end lies below its side's median estimate over the "
            f"repeats). Resolves its target: the verdict tells 0% from the target's margin: the A/A pair reads yes in "
            f"at least {NEEDED:.0%} of repeats and the slowdown at the target reads yes in at most "
            f"{1 - NEEDED:.0%}.\n\n" +
            table(["row", "commit", "clock", "target", "slowdowns", "A/A (0%)", "at target", "larger",
                   "busy-wait alone", "ratio read (0 / at / larger)", "noise", "smallest detectable", "passes",
                   "resolves its target"], lines) +
            "\nCommands (one per repeat, S = 0..{}):\n\n".format(max(repeats, default=1) - 1) +
            "".join(f"    {c}\n" for c in dict.fromkeys(commands)) + "\nChart: `calibration.png` (every "
            "repeat's reading and interval, coloured by its verdict).\n\n")


def chart(runs: list[dict], directory) -> None:
    """calibration.png: per row and side (A/A, at the target, the larger slowdown), every repeat's ratio with its
    interval, coloured by its verdict against the row's target (a red tick): what each row can tell apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [p for p in overhead.ROWS if any(r["path"] == p for r in runs)]
    calibrations = {r["path"]: calibrated_at(r["ratios"]) for r in runs}
    rows = [(path, side) for path in paths for side in calibrations[path][1]]
    labels = [f"{path} {side}" for path, side in rows]
    colours = {"yes": "tab:green", "no": "tab:red"}
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(labels) + 1.4))
    for y, (path, side) in enumerate(rows):
        target = calibrations[path][0]
        ax.plot([target] * 2, [y - 0.4, y + 0.4], color="tab:red", lw=1)
        mine = [r["ratios"][side][overhead.clock_of(path)] for r in runs if r["path"] == path]
        for k, reading in enumerate(mine):
            offset = (k - (len(mine) - 1) / 2) * 0.6 / max(len(mine), 1)  # the repeats side by side in the row
            colour = colours.get(paired.verdict(reading["interval"], target), "0.5")
            ax.plot(reading["interval"], [y + offset] * 2, color=colour, lw=1)
            ax.plot(reading["ratio"], y + offset, "o", color=colour, markersize=3)
    ax.axvline(1.0, color="k", lw=0.8)
    for label, colour in (("reads yes (under the target)", "tab:green"), ("reads no", "tab:red"),
                          ("no verdict", "0.5"), ("the row's target", None)):
        ax.plot([], [], "o-" if colour else "-", color=colour or "tab:red", label=label, markersize=3)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio read (each repeat: estimate and 95% interval), against plain")
    ax.set_title("Calibration: plain against itself (A/A) and slowed at its target and beyond", fontsize=10)
    below = 0.6 / (0.32 * len(labels) + 0.4)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -below), ncol=4, frameon=False, fontsize=8)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / "calibration.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def resummarize(quick: bool = False) -> str:
    """Summaries and markdown again from the runs a results file holds (each keeps the commit it ran at)."""
    saved = results_dir(quick) / "calibration.json"
    results = json.loads(saved.read_text())
    runs = [r for r in results["rows"] if "ratios" in r]  # the repeats; the rest are the rows' summaries
    for run in runs:
        run.setdefault("commit", results["environment"]["commit"])
    paths = [p for p in overhead.ROWS if any(r["path"] == p for r in runs)]
    rows = []
    for path in paths:
        mine = [r for r in runs if r["path"] == path]
        rows.append({**summarize_row(path, mine), "commit": "/".join(dict.fromkeys(r["commit"] for r in mine))})
    text = markdown(rows, results["config"]["commands"])
    write("calibration", {**results["config"], "summarized_again": True}, rows + runs, text, quick=quick)
    chart(runs, results_dir(quick))
    return text


def run(paths=tuple(overhead.ROWS), repeats: int = 10, quick: bool = False) -> str:
    """Calibrate `paths`; the rows of other paths in the results file are kept, each naming its commit."""
    kept, kept_runs = [], []
    saved = results_dir(quick) / "calibration.json"
    if saved.exists():
        previous = json.loads(saved.read_text())
        for record in previous["rows"]:
            if record["path"] not in paths:
                record.setdefault("commit", previous["environment"]["commit"])
                (kept_runs if "ratios" in record else kept).append(record)
    commit = environment()["commit"]
    rows, commands, raw = [], [], []
    for path in paths:
        runs = []
        for seed in range(repeats):
            print(f"calibrate: {path} repeat {seed + 1}/{repeats}", file=sys.stderr, flush=True)
            result = overhead.run_row(path, quick=quick, calibrate=True, seed=seed)
            commands.append(result["command"].replace(f"--seed {seed}", "--seed S"))
            # kept without its blocks' timings (1000 rounds x 4 sides x 3 clocks): the summary reads the ratios
            runs.append({**{k: v for k, v in result.items() if k != "samples"}, "commit": commit})
        rows.append({**summarize_row(path, runs), "commit": commit})
        raw += runs
        order = list(overhead.ROWS).index
        every = sorted(kept + rows, key=lambda r: order(r["path"]))
        every_commands = list(dict.fromkeys([r["command"].replace(f"--seed {r['seed']}", "--seed S")
                                             for r in kept_runs] + commands))
        text = markdown(every, every_commands)
        # rewritten after every row, so a run cut short keeps the rows it finished
        write("calibration", {"repeats": repeats, "quick": quick,
                              "targets": {kind: target for kind, (target, _) in overhead.CALIBRATIONS.items()},
                              "clocks": {p: overhead.clock_of(p) for p in overhead.ROWS},
                              "rows_config": {p: overhead.ROWS[p] for p in overhead.ROWS}, "commands": every_commands},
              every + kept_runs + raw, text, quick=quick)
        chart(kept_runs + raw, results_dir(quick))
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(overhead.ROWS),
                        help=f"comma-separated overhead rows, of {', '.join(overhead.ROWS)}")
    parser.add_argument("--repeats", type=int, default=10, help="fresh processes per row")
    parser.add_argument("--quick", action="store_true", help="the quick run's rounds; writes results/quick/")
    parser.add_argument("--summarize-again", action="store_true", help="measure nothing: the counts, noise and "
                        "smallest detectable slowdown again from the runs in the results file (rows keep their commit)")
    args = parser.parse_args(argv)
    paths = args.rows.split(",")
    if set(paths) - set(overhead.ROWS):
        parser.error(f"unknown row(s) {sorted(set(paths) - set(overhead.ROWS))}; choose from "
                     f"{', '.join(overhead.ROWS)}")
    if not args.quick and uncommitted():
        parser.error("a full run writes the committed results, which must come from a commit: commit (or stash) "
                     "the changes first, or pass --quick")
    print(resummarize(args.quick) if args.summarize_again else run(paths, args.repeats, args.quick))


if __name__ == "__main__":
    main()
