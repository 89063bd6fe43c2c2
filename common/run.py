"""The run directory and the step loop's bookkeeping: metrics, summary, resume, data order, preemption.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object per log step), `summary.json`,
`checkpoints/last.ckpt` and the workload's plots. Data order is a pure function of (seed, epoch), so a
run resumed at step s sees exactly the batches an uninterrupted run would have seen.
"""
import dataclasses
import itertools
import json
import os
import signal
import time
from pathlib import Path

import torch

# Fields that do not change what is computed: they may differ between a run and its resume.
RESUMABLE_CHANGES = {"out", "resume", "max_steps", "checkpoint_every", "log_every", "num_workers", "data_root",
                     "download", "devices", "num_nodes", "strategy", "accelerator"}


class RunDir:
    """A run's directory. It appears with the run's first file (config.json, written once data, models and
    any resumed checkpoint have loaded), so a run that fails to start leaves no empty folder behind."""

    def __init__(self, out: str, workload: str, write: bool = True):
        self.path = Path(out or f"runs/{workload}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.write = write  # False on every rank but 0
        self.started = time.perf_counter()
        if write:
            _check_writable(self.path)

    def _create(self) -> None:
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoints" / "last.ckpt"

    def log(self, record: dict) -> None:
        """Append one record, stamped with the seconds since the run (or its resume) started."""
        if self.write:
            self._create()
            record = {**record, "time": round(time.perf_counter() - self.started, 4)}
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    @staticmethod
    def resources() -> dict:
        """Peak memory of this process: resident set size, and the CUDA allocator's peak when on a GPU.
        On Linux the peak is VmHWM: getrusage's ru_maxrss keeps the peak of the process that forked
        this one across exec, so a script started by a large process would report that one's size."""
        status = Path("/proc/self/status")
        if status.exists():
            line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
            peak = {"peak_rss_mb": round(int(line.split()[1]) / 1024, 1)}
        else:
            import resource
            peak = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return peak

    def write_json(self, name: str, data: dict) -> None:
        if self.write:
            self._create()
            tmp = self.path / f".{name}.tmp"
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            os.replace(tmp, self.path / name)

    def metrics(self) -> list[dict]:
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def truncate_metrics(self, step: int) -> None:
        """On resume, drop records written after the checkpoint, so metrics.jsonl has each step once."""
        if self.write:
            kept = [r for r in self.metrics() if r["step"] <= step]
            with open(self.path / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def save_plain(self, state: dict) -> None:
        """The plain variant's checkpoint of `state`, written by rank 0 (the process that writes the run)."""
        if self.write:
            save_plain(self.checkpoint, state)

    def plot_losses(self, keys, name: str = "losses.png") -> None:
        if not self.write:
            return
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.metrics()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:  # markers, so that a short run's one or two logged steps still show
                ax.plot(*zip(*points), label=key, marker="o" if len(points) < 30 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.path / name, dpi=100)
        plt.close(fig)


def _check_writable(path: Path) -> None:
    """Refuse an --out that cannot be created or written, without creating anything yet."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    reason = ("is a file" if not existing.is_dir() else
              "permission denied" if not os.access(existing, os.W_OK | os.X_OK) else None)
    if reason:
        raise ValueError(f"cannot write to the run directory {path} ({existing} {reason}); pass a writable --out")


def resume_path(resume: str) -> Path:
    """`--resume` takes a run directory or a checkpoint file."""
    path = Path(resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ValueError(f"--resume {resume}: no checkpoint at {path}")
    return path


def check_resume_config(checkpoint: Path, config) -> None:
    """Refuse to resume a run whose config.json differs in a field that changes what is computed."""
    saved_path = checkpoint.parent.parent / "config.json"
    if not saved_path.is_file():
        return  # a checkpoint copied out of its run directory: the model's shapes are still checked on load
    saved = json.loads(saved_path.read_text())
    current = dataclasses.asdict(config)
    differ = [f"{key} (checkpoint {saved[key]!r}, now {current[key]!r})" for key in current
              if key in saved and key not in RESUMABLE_CHANGES and saved[key] != current[key]]
    if differ:
        raise ValueError("cannot resume: the checkpoint's run used other settings for " + ", ".join(differ) +
                         ". Pass the same flags, or start a new run.")


def batches(loader, start_step: int = 0):
    """Yield (step, batch) without end, from `start_step` on. Each epoch's order comes from the
    DistributedSampler's (seed, epoch), so resuming skips to the right batch of the right epoch."""
    epoch, skip = divmod(start_step, len(loader))
    step = start_step
    for epoch in itertools.count(epoch):
        loader.sampler.set_epoch(epoch)
        for batch in itertools.islice(loader, skip, None):
            yield step, batch
            step += 1
        skip = 0


class Preemption:
    """SIGTERM (preemption, `scancel`, `kill`) sets a flag; the loop checkpoints at the next step and exits 0."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def report(self, run: "RunDir", step: int) -> dict:
        if run.write:
            print(f"Stopped by SIGTERM at step {step}; the checkpoint is saved. Resume with --resume {run.path}")
        return {}


def check_finite(loss, step: int, checkpoint: Path) -> None:
    """Stop the run, before anything is saved, when the loss of `step` is NaN or infinite."""
    if not bool(loss.isfinite().all()):
        raise FloatingPointError(f"the loss is not finite at step {step} ({loss.item()}); stopping without "
                                 f"saving. {_last_good(checkpoint)}")


def _last_good(checkpoint: Path) -> str:
    if checkpoint.is_file():
        return f"The last good checkpoint is {checkpoint}: resume from it with a lower learning rate or another seed."
    return "No checkpoint had been written yet: start again with a lower learning rate or another seed."


def check_weights(state: dict, step: int, checkpoint: Path) -> None:
    """Refuse to write a checkpoint over a good one when an update left NaN or infinite weights (this
    process's shard of them, under a sharding strategy: the other processes then stop with it)."""
    for name, value in state.items():
        for param in getattr(value, "parameters", lambda: ())():
            local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(local.detach().isfinite().all()):
                raise FloatingPointError(f"{name} has non-finite weights after step {step}; stopping without "
                                         f"saving. {_last_good(checkpoint)}")


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A CPU generator for the random draws of one step on one rank, a pure function of (seed, rank, step):
    a resumed run draws exactly the noise the uninterrupted run drew, with no RNG state to save."""
    return torch.Generator().manual_seed(hash((seed, rank, step)) & (2**63 - 1))


def write_config(run: RunDir, config) -> None:
    run.write_json("config.json", dataclasses.asdict(config))


def save_plain(path: Path, state: dict) -> None:
    """The plain variant's checkpoint: state_dicts of the (DDP-unwrapped) models and optimizers plus plain
    values, written to a temporary file and renamed, so a crash mid-write keeps the previous checkpoint."""
    data = {key: getattr(value, "module", value).state_dict() if hasattr(value, "state_dict") else value
            for key, value in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def load_plain(path: Path, state: dict, device) -> None:
    """Restore what save_plain wrote into `state` in place (weights_only: nothing in the file is executed)."""
    saved = torch.load(path, map_location=device, weights_only=True)
    for key, value in state.items():
        if hasattr(value, "load_state_dict"):
            getattr(value, "module", value).load_state_dict(saved[key])
        else:
            state[key] = saved[key]
