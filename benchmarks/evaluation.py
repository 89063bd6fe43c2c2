"""What an evaluation during training costs the GAN's 2-process run: the first, and each later one.

    python -m benchmarks.evaluation            # writes benchmarks/results/evaluation.{json,md}
    python -m benchmarks.evaluation --quick    # into benchmarks/results/quick/

Every rank waits while rank 0 scores (`--eval-every`), so an evaluation is time the whole group loses. The first
builds the run's Scorer (the classifier, trained on the data or read from its cache, and the real images'
feature statistics); the later ones compute the generated images' features alone. Each run is the user's
command, `python -m gan.train --strategy ddp --devices 2 --eval-every N`, on the default data; its
`metrics.jsonl` records every evaluation's `eval_seconds`. Cold: an empty classifier cache (SUITE_CACHE), so the
first evaluation trains the classifier; warm: the cache from the cold run.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.record import ROOT, part_main, table, write

TARGET = 0.1  # a later evaluation costs at most a tenth of the first (issue 31)


def evaluations(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_seconds"] for r in records if "eval_seconds" in r]


def measure(steps: int, every: int, cache: Path, out: Path) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SUITE_CACHE": str(cache)}
    subprocess.run([sys.executable, "-m", "gan.train", "--accelerator", "cpu", "--strategy", "ddp", "--devices", "2",
                    "--max-steps", str(steps), "--eval-every", str(every), "--out", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    return evaluations(out)


def run_evaluation(quick: bool) -> str:
    steps, every = (60, 20) if quick else (300, 50)
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for name in ("cold", "warm"):
            seconds = measure(steps, every, cache, Path(tmp) / name)
            first, later = seconds[0], statistics.median(seconds[1:])
            records.append({"cache": name, "eval_seconds": seconds, "first_s": first, "later_median_s": later})
            rows.append([name, round(first, 3), round(later, 4), f"{later / first:.4f}",
                         "yes" if later <= TARGET * first else "**no**"])
    markdown = (f"The GAN's `--strategy ddp --devices 2 --max-steps {steps} --eval-every {every}` on the default "
                f"data (1 thread per process): rank 0's seconds per evaluation, while the other rank waits. Cold: "
                f"no cached classifier; warm: cached. Target: a later evaluation at most {TARGET:.0%} of the "
                f"first.\n\n" + table(["classifier cache", "first s", "later s (median)", "later / first", "met"],
                                       rows))
    write("evaluation", {"steps": steps, "eval_every": every}, records, markdown, quick=quick)
    return markdown


def main(argv=None):
    part_main("python -m benchmarks.evaluation", __doc__, run_evaluation, argv)


if __name__ == "__main__":
    main()
