"""Saves that go on beside training: `fabric.save(path, state, background=True)`.

The call collects the state as a save does, copies every tensor (`stage`: the staging copy, as much memory again
as the state it saves), and returns a `concurrent.futures.Future`; a thread then runs the strategy's own save of
the copy (the write, the checksums, the renames: the same code, so every kill-safety promise of a save holds: a
process killed while it runs leaves the previous checkpoint whole). Under several processes its collectives use a
process group of their own (`strategy.background_group()`), never the default group that training's use.

One save runs at a time: the next `fabric.save`, `fabric.load` or `fabric.wait_for_save()` first waits for the one
running and raises what it raised. Its ranks agreed on a lack of space inside the save, so every rank raises that
one together (`every_rank`: the scripts print it once).
"""
import atexit
import copy
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def stage(value):
    """A copy of a collected state that training can no longer change: tensors cloned (a DTensor stays a DTensor
    of this rank's shard), dicts, lists and tuples rebuilt, anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (dict, OrderedDict):
        return type(value)((key, stage(item)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(stage(item) for item in value)
    return copy.deepcopy(value)


class BackgroundSaves:
    """The background saves of one Fabric: at most one running, its outcome raised by the next wait()."""

    def __init__(self):
        self._pool = None
        self._running: Future | None = None
        self._path = None

    def start(self, path, save, state: dict, group) -> Future:
        """Run `save(path, state, group)` in the writer thread (wait() first)."""
        self.wait()
        if self._pool is None:  # its thread is joined at interpreter exit, before atexit handlers run
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core-background-save")
            atexit.register(self._report_unwaited)
        self._path, self._running = path, self._pool.submit(save, path, state, group)
        return self._running

    def wait(self) -> None:
        """Wait for the running save, if any; raise what it raised."""
        running, self._running = self._running, None
        if running is not None:
            running.result()

    def _report_unwaited(self) -> None:
        """At exit: a background save that failed with no wait() after it still says so."""
        running = self._running
        if running is not None and running.done() and running.exception() is not None:
            print(f"[core] the background save of {self._path} failed, and nothing waited for it: "
                  f"{running.exception()}", file=sys.stderr, flush=True)
