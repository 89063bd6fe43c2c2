"""Saves that go on beside training: `fabric.save(path, state, background=True)`.

The call collects the state as a save does, copies every tensor (`stage`: the staging copy, as much memory again
as the state it saves), and returns a `concurrent.futures.Future`; a thread then runs the strategy's own save of
the copy (the write, the checksums, the renames: the same code, so every kill-safety promise of a save holds: a
process killed while it runs leaves the previous checkpoint whole). Under several processes its collectives use a
process group of their own (`strategy.background_group()`), never the default group that training's use.

One save runs at a time: the next `fabric.save`, `fabric.load` or `fabric.wait_for_save()` first waits for the one
running and raises what it raised. Its ranks agreed on a lack of space inside the save, so every rank raises that
one together (`every_rank`: the scripts print it once); another error of one rank's write (rank 0's file, say)
reaches the others as their gather's time-out, as in a save in the foreground.
"""
import atexit
import copy
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def stage(value, copies: dict | None = None):
    """A copy of a collected state that training can no longer change: tensors cloned (a DTensor stays a DTensor
    of this rank's shard; one tensor under two keys, a tied weight, stays one), dicts, lists and tuples rebuilt
    (a state dict keeps its `_metadata`, the module versions its loading reads), anything else deep-copied."""
    copies = {} if copies is None else copies
    if isinstance(value, torch.Tensor):
        if id(value) not in copies:
            copies[id(value)] = value.detach().clone()
        return copies[id(value)]
    if type(value) in (dict, OrderedDict):
        out = type(value)((key, stage(item, copies)) for key, item in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if type(value) in (list, tuple):
        return type(value)(stage(item, copies) for item in value)
    return copy.deepcopy(value)


class BackgroundSaves:
    """The background saves of one Fabric: at most one running, its outcome raised by the next wait()."""

    def __init__(self):
        self._pool = None
        self._running: Future | None = None
        self._path = None

    def start(self, path, save, state: dict, group, device: torch.device) -> Future:
        """Run `save(path, state, group)` in the writer thread (wait() first), on `device` (a thread of its own
        starts on the first GPU)."""
        self.wait()
        if self._pool is None:  # its thread is joined at interpreter exit, before atexit handlers run
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core-background-save")
            atexit.register(self._report_unwaited)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the staging copies are done before the call returns

        def write():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            save(path, state, group)
        self._path, self._running = path, self._pool.submit(write)
        return self._running

    def wait(self) -> None:
        """Wait for the running save, if any, and for its Future's callbacks (a kept checkpoint's links, which
        run in the writer thread after the Future is done); raise what the save raised, once."""
        running = self._running
        if running is None:
            return
        try:
            running.result()
        finally:
            if running.done():  # (not when this wait itself was interrupted: a later one waits again)
                self._running = None
                self._pool.submit(lambda: None).result()  # one worker: it ran the callbacks before this

    def _report_unwaited(self) -> None:
        """At exit: a background save that failed with no wait() after it still says so."""
        running = self._running
        if running is not None and running.done() and running.exception() is not None:
            print(f"[core] the background save of {self._path} failed, and nothing waited for it: "
                  f"{running.exception()}", file=sys.stderr, flush=True)
