"""Rank 0 watches the ranks it started and the ranks watch rank 0, so a dead rank ends the whole run within a
second, with a message naming it, instead of leaving the others blocked in a collective."""
import os
import signal
import subprocess
import sys
import threading
import time


started: dict = {}  # rank -> Popen, in rank 0 of a re-run command


ending = threading.Event()  # rank 0's exit handler is ending the run: the watcher leaves the children to it


def stop(children: dict, grace: float = 5) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds for any rank still running."""
    for proc in children.values():
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in children.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def report_dead(children: dict, wait: float = 0.0) -> bool:
    """Name every child that exited non-zero (waiting up to `wait` s for one to); True if any did."""
    deadline = time.monotonic() + wait
    while True:
        dead = {rank: proc.poll() for rank, proc in children.items() if proc.poll() not in (None, 0)}
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for rank, code in dead.items():
        name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.Signals._value2member_map_ else ""
        print(f"[core] rank {rank} exited with code {code}{name}; stopping all ranks.", file=sys.stderr, flush=True)
    return bool(dead)


def watch(children: dict) -> None:
    started.update(children)

    def watch():
        # Once rank 0's exit handler runs, it decides. A rank leaves the end-of-run barrier only after rank 0
        # reached it, so ending is read after the exit is seen: a rank that left the barrier and exited
        # non-zero (a Ctrl-C stop: 130) is no failure.
        while not ending.is_set():
            exited = any(proc.poll() not in (None, 0) for proc in children.values())
            if exited and not ending.is_set() and report_dead(children):
                stop(children)
                os._exit(1)
            if all(proc.poll() == 0 for proc in children.values()):
                return
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="core-rank-watch").start()


def watch_parent() -> None:
    """In a re-run child: exit as soon as rank 0 (the parent) is gone, instead of hanging in a collective."""
    parent = os.environ.get("CORE_PARENT_PID")
    if parent is None:
        return
    parent = int(parent)

    def watch():
        while True:
            if os.getppid() != parent:
                print(f"[core] rank {os.environ.get('RANK')}: rank 0 (pid {parent}) is gone; exiting.",
                      file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="core-parent-watch").start()
