"""How a run stops early: signals and non-finite losses, decided by every rank together at a step boundary, and
the weight check that keeps a diverged update from overwriting the last good checkpoint."""
import os
import signal
import sys
from pathlib import Path

import torch

from common.ema import shares_of


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

    def report(self, run, step: int) -> None:
        """After the checkpoint of a stop: say so on rank 0 (`run`: the RunDir), with the command that continues the run (its
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
