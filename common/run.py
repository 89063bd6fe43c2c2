"""The step loop's bookkeeping shared by both variants: data order, the lr schedule, stops, logging, the
plain checkpoint format. (The run directory itself: `common/rundir.py`.)

Data order is a pure function of (seed, epoch), so a run resumed at step s sees exactly the batches an
uninterrupted run would have seen.
"""
import itertools
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common.ema import shares_of
from common.rundir import RunDir, cuda_peak

def batches(loader, start_step: int = 0):
    """Yield (step, batch) without end, from `start_step` on. Each epoch's order comes from the
    DistributedSampler's (seed, epoch), so resuming skips to the right batch of the right epoch."""
    if len(loader) == 0:
        raise ValueError("the data loader yields no batch: --batch-size times the number of processes is more "
                         "than the examples of the dataset; lower --batch-size")
    epoch, skip = divmod(start_step, len(loader))
    step = start_step
    for epoch in itertools.count(epoch):
        loader.sampler.set_epoch(epoch)
        for batch in itertools.islice(loader, skip, None):
            yield step, batch
            step += 1
        skip = 0


def accumulated(loader, start_step: int, micro_batches: int):
    """Yield (step, [batch, ...]) without end: `micro_batches` consecutive batches of `batches` per step, so
    that a step of N micro-batches of size B sees exactly the examples of one batch of size N * B."""
    stream = batches(loader, start_step * micro_batches)
    for step in itertools.count(start_step):
        yield step, [batch for _, batch in itertools.islice(stream, micro_batches)]


def lr_scheduler(optimizer: torch.optim.Optimizer, config) -> torch.optim.lr_scheduler.LambdaLR:
    """--lr-schedule as a scheduler stepped once per optimizer step: a factor 1 (constant), or a linear warm-up
    from 1/(W+1) to 1 over W = --warmup-steps steps, then a cosine from 1 to 0 at --max-steps (cosine)."""
    warmup, total = config.warmup_steps, config.max_steps

    def factor(step: int) -> float:
        if config.lr_schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class StopRequests:
    """Early stops, decided by every rank together at a step boundary.

    SIGTERM (preemption, `scancel`, `kill`) and SIGINT (Ctrl-C) on any rank ask for a stop: every rank
    stops after the same step, the loop saves its checkpoint, and `report` ends the run (exit 0 after
    SIGTERM, 130 after SIGINT). A second Ctrl-C ends the process at once. A non-finite loss on any rank
    stops every rank with a FloatingPointError before anything is saved.

    `reduce` sums or averages a tensor over the ranks (in place or returned): `dist.all_reduce` or
    `fabric.all_reduce`; None on one process. The ranks compare their requests every `every` steps and
    at every step whose loss is checked: one all-reduce of 3 numbers costs ~0.8 ms over gloo on 2 CPU
    processes, 13% of a 6 ms MAML step if it ran every step (benchmarks/overhead.py, stop_check_cost).
    """

    def __init__(self, device=None, reduce=None, every: int = 10):
        self.device = torch.device("cpu") if reduce is None or device is None else device
        self.reduce = reduce
        self.every = every
        self.signals = {signal.SIGTERM: 0, signal.SIGINT: 0}  # received by this process
        self.reason = None  # "SIGTERM" or "SIGINT" once the ranks agreed to stop
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.signals}

    def close(self) -> None:
        """After the loop: signals act at once again (nothing would check the requests any more)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        self.signals[signum] += 1
        if signum == signal.SIGINT and self.signals[signum] > 1:
            sys.stderr.write("Interrupted twice: stopping now, without a checkpoint of this step.\n")
            sys.stderr.flush()
            os._exit(130)

    def check(self, step: int, loss: torch.Tensor | None, checkpoint: Path) -> bool:
        """True when any rank asked to stop; raise when `loss` (None: not checked at this step) is not
        finite on any rank. Every rank must call it at every step, with a loss at the same steps."""
        if self.reduce is not None and loss is None and (step + 1) % self.every:
            return False  # not a step where the ranks compare
        flags = torch.tensor([self.signals[signal.SIGTERM], self.signals[signal.SIGINT], 0.0], device=self.device)
        if loss is not None:
            flags[2] = (~loss.detach().isfinite().all()).to(flags.dtype)
        if self.reduce is not None:
            reduced = self.reduce(flags)
            flags = reduced if isinstance(reduced, torch.Tensor) else flags
        sigterm, sigint, not_finite = (float(x) > 0 for x in flags.tolist())
        if not_finite:
            where = f"{loss.item()} on this process" if not bool(loss.isfinite().all()) else "on another process"
            raise FloatingPointError(f"the loss is not finite at step {step} ({where}); stopping without "
                                     f"saving. {_last_good(checkpoint)}")
        if sigint or sigterm:
            self.reason = "SIGINT" if sigint else "SIGTERM"
        return self.reason is not None

    def report(self, run: "RunDir", step: int) -> None:
        """After the checkpoint of a stop: say so on rank 0, with the command that continues the run (its
        flags come back from its config.json), and end the run (exit 130 after Ctrl-C)."""
        if run.write:
            print(f"Stopped by {self.reason} at step {step}; the checkpoint is saved. Resume with: "
                  f"{resume_command(run.path)}", flush=True)
        if self.reason == "SIGINT":
            sys.exit(130)


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in `run_dir`: this script with --resume (under torchrun or srun,
    the same launcher command around it)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    script = f"python -m {spec.name}" if spec is not None and spec.name else f"python {sys.argv[0]}"
    launcher = "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ
    return f"{script} --resume {run_dir}" + (" (inside the same torchrun or srun command)" if launcher else "")


def _last_good(checkpoint: Path) -> str:
    if checkpoint.exists():
        return f"The last good checkpoint is {checkpoint}: resume from it with a lower learning rate or another seed."
    return "No checkpoint had been written yet: start again with a lower learning rate or another seed."


def check_weights(state: dict, step: int, checkpoint: Path) -> None:
    """Refuse to write a checkpoint over a good one when an update left NaN or infinite weights (this
    process's shard of them, under a sharding strategy: the other processes then stop with it)."""
    for name, value in state.items():
        shares = shares_of(value)
        for param in getattr(value, "parameters", lambda: ())():
            if not shares.finite(param):
                raise FloatingPointError(f"{name} has non-finite weights after step {step}; stopping without "
                                         f"saving. {_last_good(checkpoint)}")


class Bookkeeping:
    """What every training loop does after its optimizer steps, the same in the plain and the wrapped script:
    count the step (`state["step"]`), move the progress bar, log every `log_every` steps, let the ranks decide
    together whether to stop (`stop`, a StopRequests), and check the weights before each checkpoint. The
    loop itself (data, forward, backward, optimizer steps) and the saving stay in the script:

        loop = Bookkeeping(config, state, run, stop, "gan", config.batch_size * world_size)
        for step, batch in batches(loader, state["step"]):
            ...                                                  # the training step
            if loop.end_step(step, loss, lambda: {"loss": loss.item()}):
                break                                            # every rank stops after this step
            if loop.checkpoint_due():
                fabric.save(run.checkpoint, state)
        loop.close()
        fabric.save(run.checkpoint, state)
        if stop.reason:
            return stop.report(run, state["step"])
    """

    def __init__(self, config, state: dict, run: RunDir, stop: StopRequests, name: str, examples_per_step: int):
        """`examples_per_step`: what one step trains on across all processes (images, or tasks for MAML), for
        the throughput in each record."""
        self.config, self.state, self.run, self.stop = config, state, run, stop
        self.examples_per_step = examples_per_step
        self.progress = tqdm(total=config.max_steps, initial=state["step"], disable=not run.write, desc=name)
        self._since = (state["step"], time.perf_counter())  # the last log step and its time

    def end_step(self, step: int, loss: torch.Tensor, metrics) -> bool:
        """After step `step`: True when the ranks agreed to stop (save, then `stop.report`). On log steps
        (every `log_every`, and the last) the loss is checked on every rank, and `metrics()` (a dict of
        numbers, called only then: `.item()` waits for the device) is written to metrics.jsonl."""
        self.state["step"] = step + 1
        self.progress.update()
        log = self.state["step"] % self.config.log_every == 0 or self.state["step"] == self.config.max_steps
        stopping = self.stop.check(step, loss if log else None, self.run.checkpoint)
        if log:
            record = {**metrics(), **self._throughput()}  # after metrics(): its .item() waits for the device
            self.run.log({"step": self.state["step"], **record})
        return stopping

    def _throughput(self) -> dict:
        """Examples per second since the last log step (wall time: everything the loop did in between), and on
        CUDA the peak memory the allocator has held so far."""
        (last_step, last_time), now = self._since, time.perf_counter()
        self._since = (self.state["step"], now)
        record = {"examples_per_s": round((self.state["step"] - last_step) * self.examples_per_step
                                          / max(now - last_time, 1e-9), 1)}
        return {**record, **cuda_peak()}

    def checkpoint_due(self) -> bool:
        """True every `checkpoint_every` steps, once the weights are checked (a FloatingPointError if any is
        not finite, so a diverged update never overwrites the last good checkpoint)."""
        if not (self.config.checkpoint_every and self.state["step"] % self.config.checkpoint_every == 0):
            return False
        check_weights(self.state, self.state["step"], self.run.checkpoint)
        return True

    def close(self) -> None:
        """After the loop, before the final checkpoint: close the progress bar, let signals act at once
        again, and check the weights."""
        self.progress.close()
        self.stop.close()
        self.run.finalize()
        check_weights(self.state, self.state["step"], self.run.checkpoint)


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A CPU generator for the random draws of one step on one rank, a pure function of (seed, rank, step):
    a resumed run draws exactly the noise the uninterrupted run drew, with no RNG state to save."""
    return torch.Generator().manual_seed(hash((seed, rank, step)) & (2**63 - 1))
