"""Each workload's default step against this machine: how near the GAN and the autoencoder run to what this CPU
can do on their own shapes, and where the rest of the time goes.

    python -m benchmarks.machine            # writes benchmarks/results/machine.{json,md}
    python -m benchmarks.machine --quick    # fewer steps, into benchmarks/results/quick/

Each workload's plain script (`python -m <workload>.train_torch`, default data and flags, 1 thread) runs in this
process; a hook after every optimizer step (torch's global `register_optimizer_step_post_hook`) marks the steps,
so the windows below are the user's own loop, data loading and bookkeeping included:
- warm-up steps, then a timed window: the median step time (wall clock between step ends);
- one step counted: every matmul and convolution it dispatches, with its FLOPs by torch's FlopCounterMode and
  its arguments' shapes (a dispatch mode beside it records them; both must agree);
- a profiled window: torch.profiler's self CPU time per op, the ops that take the most.
The run is then stopped; its end-of-run evaluation is not measured.

Against the machine: each recorded call is replayed alone on fresh tensors of its shapes, strides and dtype, best of
5 timed loops; their sum is what the step's FLOPs take at the speed this thread reaches on the step's own shapes.
The fraction of the machine is that sum over the step's time: the achieved FLOP/s over the shape-matched rate.
A large square matmul's rate stands beside it for scale. FLOPs count matmuls and convolutions only
(elementwise work, the optimizer and the data are left out), as MAML's row in maml_speed.md counts them.
"""
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from benchmarks.record import best_seconds, part_main, table, write

WORKLOADS = ("gan", "autoencoder")
OPTIMIZERS_PER_STEP = {"gan": 2, "autoencoder": 1}  # D's and G's step; the autoencoder's one
TOP_OPS = 6


class _Finished(Exception):
    """Raised from the step hook once every window is measured: the run stops there."""


class Recorder(TorchDispatchMode):
    """Every call of an op torch's flop counter counts (matmuls, convolutions): the op with its arguments, tensors
    as (shape, stride, dtype), how many times the step made it, and its FLOPs."""

    def __init__(self):
        super().__init__()
        self.calls, self.flops = Counter(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            key = (func, _spec(args), _spec(tuple(sorted(kwargs.items()))))
            self.calls[key] += 1
            self.flops[key] = count(*args, **kwargs, out_val=out)
        return out


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class ListSpec:
    items: tuple


def _spec(value):
    """A hashable description of an op's arguments, tensors by shape, stride and dtype."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, list):
        return ListSpec(tuple(_spec(v) for v in value))
    if isinstance(value, tuple):
        return tuple(_spec(v) for v in value)
    return value


def _build(spec):
    """Fresh arguments from `_spec`'s description: random values of the same shapes, strides and dtypes."""
    if isinstance(spec, TensorSpec):
        return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype).normal_()
    if isinstance(spec, ListSpec):
        return [_build(v) for v in spec.items]
    if isinstance(spec, tuple):
        return tuple(_build(v) for v in spec)
    return spec


def replayed_seconds(recorder: Recorder) -> dict:
    """Each recorded call alone, at its best speed: {op name: seconds per step}, every call of the step counted."""
    per_op = Counter()
    for key, calls in recorder.calls.items():
        func, args, kwargs = key
        args, kwargs = _build(args), dict(_build(kwargs))
        per_op[str(func._overloadpacket).removeprefix("aten.")] += calls * best_seconds(lambda: func(*args, **kwargs))
    return dict(per_op)


def square_matmul_rate(n: int = 1024) -> float:
    """This thread's FLOP/s on an n x n @ n x n float32 matmul: the machine's rate on a shape that suits it."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2.0 * n ** 3 / best_seconds(lambda: torch.mm(a, b, out=out), seconds=1.0)


class Windows:
    """The step hook: step ends' times, then one counted step, then a profiled window, then stop."""

    def __init__(self, per_step: int, warmup: int, timed: int, profiled: int):
        self.per_step, self.warmup, self.timed, self.profiled = per_step, warmup, timed, profiled
        self.optimizer_steps, self.ends = 0, []
        self.counter, self.recorder = FlopCounterMode(display=False), Recorder()
        if not torch.cuda.is_available():  # kineto's log (profiler_start, a failed gpuGetDeviceCount) says nothing here
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # (read when the first profiler starts)
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def __call__(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1
        if self.optimizer_steps % self.per_step:
            return
        step = self.optimizer_steps // self.per_step  # steps finished
        counted = self.warmup + self.timed
        if self.warmup <= step <= counted:
            self.ends.append(time.perf_counter())
        if step == counted:  # the next step is counted: the counter outside, the recorder inside it
            self.counter.__enter__()
            self.recorder.__enter__()
        elif step == counted + 1:
            self.recorder.__exit__(None, None, None)
            self.counter.__exit__(None, None, None)
            self.profiler.start()
        elif step == counted + 1 + self.profiled:
            self.profiler.stop()
            raise _Finished


def measure_workload(name: str, warmup: int, timed: int, profiled: int) -> dict:
    import importlib
    script = importlib.import_module(f"{name}.train_torch")
    config = importlib.import_module(f"{name}.config").Config()
    windows = Windows(OPTIMIZERS_PER_STEP[name], warmup, timed, profiled)
    hook = register_optimizer_step_post_hook(windows)
    try:
        with tempfile.TemporaryDirectory() as out:
            config.out, config.max_steps = out, warmup + timed + profiled + 2
            config.check()
            try:
                script.main(config)
            except _Finished:
                pass
            else:
                raise RuntimeError(f"{name}.train_torch finished before the windows were measured")
    finally:
        hook.remove()
    steps = [b - a for a, b in zip(windows.ends, windows.ends[1:])]
    step_s = statistics.median(steps)
    flops = float(sum(windows.recorder.calls[k] * windows.recorder.flops[k] for k in windows.recorder.calls))
    if flops != windows.counter.get_total_flops():
        raise RuntimeError(f"the recorder's {flops} FLOPs differ from FlopCounterMode's "
                           f"{windows.counter.get_total_flops()}: it missed an op")
    replayed = replayed_seconds(windows.recorder)
    averages = windows.profiler.key_averages()
    total = sum(e.self_cpu_time_total for e in averages)
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return {"workload": name, "step_s": step_s, "step_min_s": min(steps), "step_max_s": max(steps),
            "timed_steps": len(steps), "flops_per_step": flops, "achieved_flops_per_s": flops / step_s,
            "replayed_s": replayed, "shape_matched_flops_per_s": flops / sum(replayed.values()),
            "fraction": sum(replayed.values()) / step_s,
            "profile": [{"op": e.key, "share": e.self_cpu_time_total / total,
                         "calls_per_step": e.count / profiled} for e in top]}


def run_machine(quick: bool) -> str:
    warmup, timed, profiled = (10, 30, 5) if quick else (20, 200, 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [measure_workload(name, warmup, timed, profiled) for name in WORKLOADS]
        square = square_matmul_rate()
    finally:
        torch.set_num_threads(threads)
    lines, notes = [], []
    for r in rows:
        lines.append([r["workload"], f"{1e3 * r['step_s']:.2f} ({1e3 * r['step_min_s']:.1f}-"
                                     f"{1e3 * r['step_max_s']:.1f})",
                      r["flops_per_step"] / 1e6, r["achieved_flops_per_s"] / 1e9,
                      r["shape_matched_flops_per_s"] / 1e9, f"{r['fraction']:.1%}"])
        ops = ", ".join(f"{p['op']} {p['share']:.0%}" for p in r["profile"])
        replayed = ", ".join(f"{op} {1e3 * s:.2f} ms" for op, s in sorted(r["replayed_s"].items(),
                                                                         key=lambda item: -item[1]))
        notes.append(f"- **{r['workload']}**: its matmuls and convolutions alone, each at its best speed: "
                     f"{replayed} per step. Self CPU time by op over {profiled} profiled steps: {ops}.")
    markdown = (f"Each workload's default command (`python -m <workload>.train_torch`: default data and flags, 1 "
                f"thread), measured inside its own loop: the median step over {timed} steps after {warmup} of "
                f"warm-up (wall clock between optimizer steps: data, bookkeeping and the optimizer included); the "
                f"FLOPs of one step's matmuls and convolutions (torch's FlopCounterMode) and the rate they run at; "
                f"the rate this thread reaches on the step's own calls, each replayed alone on its own shapes; the "
                f"fraction of that the step reaches. For scale, a 1024 x 1024 matmul runs at "
                f"{square / 1e9:.1f} GFLOP/s here. MAML's row is in the maml_speed table.\n\n"
                + table(["workload", "step ms (min-max)", "MFLOP/step", "achieved GFLOP/s",
                         "shape-matched GFLOP/s", "fraction of the machine"], lines)
                + "\n" + "\n".join(notes) + "\n")
    write("machine", {"warmup": warmup, "timed": timed, "profiled": profiled},
          [{**r, "square_matmul_flops_per_s": square} for r in rows], markdown, quick=quick)
    return markdown


def main(argv=None):
    part_main("python -m benchmarks.machine", __doc__, run_machine, argv)


if __name__ == "__main__":
    main()
