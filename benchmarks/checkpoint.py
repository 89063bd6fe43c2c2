"""Saving and loading an FSDP model on 2 processes: sharded (what core writes: every rank writes its own
shards through torch.distributed.checkpoint), the same save in the background (`background=True`: the call
returns once the state is copied; then the wait for the write), against gathered (the full state dicts
collected on rank 0's CPU and written by it, as core did before, and as a one-file checkpoint needs).

    python -m benchmarks.checkpoint --params 100e6      # prints one JSON object; benchmarks.run tabulates it

The model is a stack of square Linear layers of about --params parameters, with Adam's state after one
step (3 tensors per weight in all). Memory is rank 0's resident set: a thread samples it every 2 ms during
each save and load; the figure is the peak above what the process held just before (its shard, the
sharded model and optimizer; glibc's mmap threshold is fixed so that freed buffers leave it). Times are wall seconds of the whole call, all ranks, median of --repeats.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from core import checkpoint
from core.checkpoint import integrity
from core.compat import Fabric  # for init_module(empty_init=True), which the drop-in offers

PAGE = os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """The peak resident set of this process above its level at the start, in MB, sampled every 2 ms."""

    def __enter__(self):
        self.start = self.peak = self._rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.extra_mb = (self.peak - self.start) / 2**20

    def _watch(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE


def build(fabric, params: float):
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model = fabric.setup_module(model, fsdp={"wrap_modules": [nn.Linear]})
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-4))
    return model, optimizer, width


def gathered_save(fabric, path, state):
    """The one-file way: full state dicts on rank 0's CPU, written by it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = {"model": get_model_state_dict(state["model"].module, options=options),
            "optimizer": get_optimizer_state_dict(state["model"].module, state["optimizer"].optimizer,
                                                  options=options)}
    if fabric.is_global_zero:
        checkpoint.save_checkpoint(full, path)
    fabric.barrier()


def gathered_load(fabric, path, state):
    """Every rank reads the whole file, then keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    full = checkpoint.load_checkpoint(path)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(state["model"].module, full["model"], options=options)
    set_optimizer_state_dict(state["model"].module, state["optimizer"].optimizer, full["optimizer"], options=options)


def timed(fabric, call, *args):
    fabric.barrier()
    with PeakMemory() as memory:
        start = time.perf_counter()
        call(*args)
        fabric.barrier()
        seconds = time.perf_counter() - start
    return seconds, memory.extra_mb


def main():
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc otherwise raises its mmap threshold after the first large free and keeps later buffers in a
        # heap it does not give back, so the resident set would miss a second peak: every tensor-sized
        # allocation is its own mapping, returned when freed
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.checkpoint", *sys.argv[1:]],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the model (about)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="", help="where to write the checkpoints (default: a temporary folder)")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
    fabric.launch()
    model, optimizer, width = build(fabric, args.params)
    fabric.backward(model(torch.randn(2, width)).square().mean())
    optimizer.step()  # Adam's state exists: 3 tensors per weight
    state = {"model": model, "optimizer": optimizer, "step": 1}
    count = sum(p.numel() for p in model.parameters())
    shard_mb = sum(p.to_local().numel() * 4 for p in model.parameters()) * 3 / 2**20
    root = Path(fabric.broadcast(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")))
    rows = {"sharded": {"save": [], "load": [], "verify": [], "manifest": []},
            "gathered": {"save": [], "load": []}, "background": {"save": [], "wait": []}}
    for _ in range(args.repeats):
        for kind, save, load in (("sharded", fabric.save, fabric.load), ("gathered", lambda p, s: gathered_save(
                fabric, p, s), lambda p, s: gathered_load(fabric, p, s))):
            path = root / f"{kind}.ckpt"
            rows[kind]["save"].append(timed(fabric, save, path, state))
            rows[kind]["load"].append(timed(fabric, load, path, state))
        # inside the sharded load and save: checking the files' checksums (the ranks share the files out), and
        # rank 0 writing them at the save (the files are in the page cache in both, as after a save)
        rows["sharded"]["verify"].append(timed(fabric, fabric.strategy.verify_checkpoint, root / "sharded.ckpt"))
        rows["sharded"]["manifest"].append(timed(fabric, lambda: fabric.is_global_zero and integrity.write_manifest(
            root / "sharded.ckpt")))
        # the sharded save in the background: what a training step waits for (the staging copy), and the rest
        rows["background"]["save"].append(timed(fabric, lambda: fabric.save(root / "background.ckpt", state,
                                                                             background=True)))
        rows["background"]["wait"].append(timed(fabric, fabric.wait_for_save))
    if fabric.is_global_zero:
        result = {"parameters": count, "rank0_shard_mb": round(shard_mb, 1)}
        for kind, phases in rows.items():
            for phase, samples in phases.items():
                result[f"{kind}_{phase}_s"] = round(statistics.median(s for s, _ in samples), 3)
                result[f"{kind}_{phase}_rank0_extra_mb"] = round(statistics.median(m for _, m in samples), 1)
        print("RESULT " + json.dumps(result), flush=True)
        if not args.dir:
            import shutil
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
