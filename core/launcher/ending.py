"""The end of a run: every rank meets the others at its exit (bounded), tears the process group down, and rank 0
stops the ranks it started when one of them, or it, failed."""
import atexit
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext

from core.launcher import children


_failed = False  # this process is failing: an uncaught exception, or an error the CLI reported (mark_failed)


def mark_failed() -> None:
    """Say that this process is about to exit with an error (a one-line CLI error, a diverged run), so
    that its exit does not wait for the other ranks: they may be blocked in a collective with this one.
    Rank 0 then stops the other ranks at once; another rank exits, and rank 0 sees it and stops the rest."""
    global _failed
    _failed = True


def end_run_at_exit(teardown) -> None:
    """At this process's exit, end the run with the other ranks: when every rank reached its exit, tear
    the process group down (and, in rank 0 of a re-run, wait for the others); when rank 0 leaves while
    another rank has not finished (an error, a non-zero exit), stop those ranks instead of waiting on
    them. Every wait is bounded: rank 0 waits CORE_EXIT_TIMEOUT seconds (default 5) for the others."""
    previous_hook = sys.excepthook

    def on_error(kind, value, tb):  # an uncaught exception: no rank will meet this one at its exit
        mark_failed()
        if children.started and children.report_dead(children.started, wait=2.0):  # the cause: another rank left mid-collective
            first = (str(value).strip().splitlines() or [""])[0][:200]
            print(f"[core] rank 0 stopped too ({kind.__name__}: {first})", file=sys.stderr, flush=True)
            return
        previous_hook(kind, value, tb)

    sys.excepthook = on_error
    atexit.register(_end_run, teardown)


def _end_run(teardown) -> None:
    import torch.distributed as dist

    children.ending.set()
    rank = dist.get_rank() if dist.is_initialized() else 0
    finished = not _failed and dist.is_initialized() and _all_ranks_finished(rank)
    if finished:
        teardown()
    if not children.started:
        return
    if finished:
        _wait_or_stop(children.started, float(os.environ.get("CORE_EXIT_TIMEOUT", 5)) * 6)
        return
    running = [r for r, proc in children.started.items() if proc.poll() is None]
    if not _failed and not children.report_dead(children.started) and running:
        print(f"[core] rank 0 is exiting before rank(s) {', '.join(map(str, running))} finished; stopping them.",
              file=sys.stderr, flush=True)
    children.stop(children.started, grace=2)


def _all_ranks_finished(rank: int) -> bool:
    """A barrier with a bound: True when every rank reached it. Rank 0 waits CORE_EXIT_TIMEOUT seconds;
    the others wait for rank 0, which may still be writing results, up to 30 minutes."""
    import datetime

    import torch.distributed as dist

    seconds = float(os.environ.get("CORE_EXIT_TIMEOUT", 5)) if rank == 0 else 1800
    quiet = _stderr_without("monitoredBarrier") if rank == 0 else nullcontext()  # gloo logs each late rank
    try:
        with quiet:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
        return True
    except RuntimeError:
        return False


@contextmanager
def _stderr_without(marker: str):
    """Hold back the lines of the C++ logger (which writes to file descriptor 2) that contain `marker`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if marker not in line))
            sys.stderr.flush()


def _wait_or_stop(ranks: dict, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for rank, proc in ranks.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"[core] rank {rank} is still running {seconds:.0f} s after the run ended; stopping it.",
                  file=sys.stderr, flush=True)
    children.stop(ranks, grace=2)
