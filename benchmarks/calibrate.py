"""Calibration of the overhead verdicts: can each row of benchmarks/overhead.py tell a slowdown on this machine?

    python -m benchmarks.calibrate                       # every row, 10 repeats, the full run's rounds
    python -m benchmarks.calibrate --rows 32-true --repeats 3 --quick

Each repeat is one fresh process (`python -m benchmarks.overhead PATH --calibrate --seed S`) that interleaves
four sides in the row's blocks: plain, plain again (the A/A pair), and plain again slowed by a busy-wait of 3%
and of 10% of the plain step (benchmarks/paired.py). Slowing a copy of plain, rather than the wrapped side,
makes the true ratio known (1, 1.03, 1.10) whatever the wrapper costs. Each side's ratio to plain gets the
verdict the overhead table uses (target 1.03). What a row must show: the A/A pair reads "yes" or "no verdict"
(never "no") in at least 9 of 10 repeats, and the 10% slowdown reads "no" in at least 9 of 10. The smallest
slowdown a row detects (paired.detectable): 3% plus the 90th percentile, over all its intervals, of how far an
interval's lower end lies below its estimate. Results: benchmarks/results/calibration.md and .json.
"""
import argparse
import statistics
import sys

from benchmarks import overhead, paired
from benchmarks.record import table, uncommitted, write

TARGET = 1.03
CLOCK = "cpu"  # the clock the verdicts are taken on (paired.CLOCKS: the others are recorded beside it)
NEEDED = 0.9  # of the repeats: A/A never "no", the 10% slowdown "no"


def outcome(verdicts: list[str]) -> dict:
    return {"yes": verdicts.count("yes"), "no": verdicts.count("no"),
            "no verdict": sum(v.startswith("no verdict") for v in verdicts)}


def summarize_row(path: str, runs: list[dict], clock: str = CLOCK) -> dict:
    """Counts of each verdict per calibration side, the intervals' noise, and the smallest detectable slowdown."""
    sides, intervals, estimates = {}, [], []
    for side in overhead.CALIBRATION:
        ratios = [run["ratios"][side][clock] for run in runs]
        verdicts = [paired.verdict(r["interval"], TARGET) for r in ratios]
        intervals += [r["interval"] for r in ratios]
        estimates += [r["ratio"] for r in ratios]
        sides[side] = {"verdicts": verdicts, **outcome(verdicts),
                       "ratio_median": statistics.median(r["ratio"] for r in ratios),
                       "spin_alone_median": statistics.median(run["spin_alone"].get(side, 0.0) for run in runs)}
    aa, slowed = sides["a/a"], sides["a/a+10%"]
    passed = aa["no"] <= (1 - NEEDED) * len(runs) and slowed["no"] >= NEEDED * len(runs)
    return {"path": path, "clock": clock, "repeats": len(runs), "sides": sides, "passed": passed,
            "noise_pct_median": statistics.median(paired.noise(i) for i in intervals),
            "detectable": paired.detectable(intervals, estimates, TARGET)}


def markdown(rows: list[dict], commands: list[str]) -> str:
    lines = []
    for r in rows:
        s = r["sides"]
        lines.append([r["path"], *(f"{s[side]['yes']} / {s[side]['no']} / {s[side]['no verdict']}"
                                   for side in overhead.CALIBRATION),
                      f"{s['a/a+3%']['spin_alone_median']:.1%}, {s['a/a+10%']['spin_alone_median']:.1%}",
                      " / ".join(f"{s[side]['ratio_median']:.3f}" for side in overhead.CALIBRATION),
                      f"+-{r['noise_pct_median']:.1f}%", f"{r['detectable']:.1%}",
                      "yes" if r["passed"] else "**no**"])
    repeats = rows[0]["repeats"] if rows else 0
    return (f"Calibration of the overhead verdicts ({repeats} repeats per row, each a fresh process; verdicts on "
            f"{CLOCK} time, target {TARGET}): each repeat interleaves plain, plain again (A/A), and plain again "
            f"slowed by a busy-wait of 3% and 10% of the plain step, in the row's own blocks and rounds. Counts "
            f"are yes / no / no verdict. A row passes when the A/A pair never reads no in more than "
            f"{1 - NEEDED:.0%} of repeats and the 10% slowdown reads no in at least {NEEDED:.0%}. The busy-wait "
            f"is sized after the warm-up to 3% and 10% of the plain step; busy-wait alone: it timed again alone "
            f"after the rounds, against the rounds' own plain step (median over repeats); ratio read: the median "
            f"estimate of each side, which is what the slowdown came to inside the steps. Noise: the median interval "
            f"half-width. Smallest detectable: the slowdown that would read no in 9 of 10 repeats (3% plus the "
            f"90th percentile of how far an interval's lower end lies below its estimate).\n\n" +
            table(["row", "A/A (0%)", "+3%", "+10%", "busy-wait alone (3, 10%)", "ratio read (0 / 3 / 10%)", "noise", "smallest detectable", "passes"], lines) +
            "\nCommands (one per repeat, S = 0..{}):\n\n".format(repeats - 1) +
            "".join(f"    {c}\n" for c in dict.fromkeys(commands)) + "\n")


def run(paths=tuple(overhead.ROWS), repeats: int = 10, quick: bool = False) -> str:
    rows, commands, raw = [], [], []
    for path in paths:
        runs = []
        for seed in range(repeats):
            print(f"calibrate: {path} repeat {seed + 1}/{repeats}", file=sys.stderr, flush=True)
            result = overhead.run_row(path, quick=quick, calibrate=True, seed=seed)
            commands.append(result["command"].replace(f"--seed {seed}", "--seed S"))
            runs.append(result)
        rows.append(summarize_row(path, runs))
        raw += runs
        text = markdown(rows, commands)
        # rewritten after every row, so a run cut short keeps the rows it finished
        write("calibration", {"repeats": repeats, "quick": quick, "target": TARGET, "clock": CLOCK,
                              "rows_config": {p: overhead.ROWS[p] for p in paths}, "commands": list(dict.fromkeys(commands))},
              rows + raw, text, quick=quick)
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(overhead.ROWS),
                        help=f"comma-separated overhead rows, of {', '.join(overhead.ROWS)}")
    parser.add_argument("--repeats", type=int, default=10, help="fresh processes per row")
    parser.add_argument("--quick", action="store_true", help="the quick run's rounds; writes results/quick/")
    args = parser.parse_args(argv)
    paths = args.rows.split(",")
    if set(paths) - set(overhead.ROWS):
        parser.error(f"unknown row(s) {sorted(set(paths) - set(overhead.ROWS))}; choose from {', '.join(overhead.ROWS)}")
    if not args.quick and uncommitted():
        parser.error("a full run writes the committed results, which must come from a commit: commit (or stash) "
                     "the changes first, or pass --quick")
    print(run(paths, args.repeats, args.quick))


if __name__ == "__main__":
    main()
