"""Where the suite's time goes: the CPU seconds (this process and the processes it waited for) and wall seconds of
every test, setup and teardown included, written by the suite itself at the end of a run.

    python -m pytest -q --timings runs/timings.json    # or, without the flag, <pytest's basetemp>/timings.json
    python -m tests.timings runs/timings.json          # the 20 tests that cost the most CPU, and the totals

A test's children are counted when they have ended and been waited for (subprocess.run, Process.join); a rank's
CPU reaches its launcher the same way, so a 2-rank run is charged to the test that started it. Under pytest-xdist
each worker measures its own tests and the numbers ride to the controller on the test's report.
"""
import argparse
import json
import resource
import sys
import time
from pathlib import Path

KEY = "suite-timing"


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class Timings:
    """A pytest plugin: measures each test on the process that runs it, gathers on the one that reports."""

    def __init__(self, path: Path | None):
        self.path = path
        self.rows: list[dict] = []

    def pytest_runtest_logstart(self, nodeid, location):
        self._start = (time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))

    def pytest_runtest_makereport(self, item, call):
        if call.when == "teardown":  # setup, call and teardown have all run: the report made now carries the row
            wall, own, children = self._start
            item.user_properties.append((KEY, {
                "wall": time.perf_counter() - wall,
                "cpu_self": _cpu(resource.RUSAGE_SELF) - own,
                "cpu_children": _cpu(resource.RUSAGE_CHILDREN) - children}))

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            for name, row in report.user_properties:
                if name == KEY:
                    worker = getattr(report, "node", None)  # xdist's controller knows which worker ran it
                    self.rows.append({"test": report.nodeid, **row,
                                      "worker": worker.gateway.id if worker is not None else "main"})

    def pytest_sessionfinish(self, session):
        if hasattr(session.config, "workerinput"):
            return  # a worker: its rows went out on its reports
        path = self.path or session.config._tmp_path_factory.getbasetemp() / "timings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sorted(self.rows, key=lambda row: -row["cpu_self"] - row["cpu_children"]),
                                   indent=1))
        self.written = path

    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self, "written", None):
            terminalreporter.write_line(f"per-test CPU and wall time: {self.written} "
                                        f"(python -m tests.timings {self.written})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.timings", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="the timings.json a run of the suite wrote")
    parser.add_argument("--top", type=int, default=20, help="how many tests to list (default 20)")
    parser.add_argument("--by", choices=["cpu", "wall"], default="cpu", help="order by CPU seconds or wall seconds")
    args = parser.parse_args(argv)
    if not args.path.is_file():
        parser.error(f"{args.path} is not a file: give the timings.json a run of the suite wrote "
                     "(pytest --timings PATH, or the path its last line printed)")
    rows = json.loads(args.path.read_text())
    for row in rows:
        row["cpu"] = row["cpu_self"] + row["cpu_children"]
    rows.sort(key=lambda row: -row[args.by])
    print(f"{'cpu s':>8} {'self':>7} {'wall s':>8}  test")
    for row in rows[:args.top]:
        print(f"{row['cpu']:8.1f} {row['cpu_self']:7.1f} {row['wall']:8.1f}  {row['test']}")
    print(f"{sum(r['cpu'] for r in rows):8.1f} {sum(r['cpu_self'] for r in rows):7.1f} "
          f"{sum(r['wall'] for r in rows):8.1f}  all {len(rows)} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
