"""The run directory and the step loop's bookkeeping: metrics, summary, resume, data order, preemption.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object per log step), `summary.json`,
`checkpoints/last.ckpt` and the workload's plots. Data order is a pure function of (seed, epoch), so a
run resumed at step s sees exactly the batches an uninterrupted run would have seen.
"""
import dataclasses
import itertools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

# Fields that do not change what is computed: they may differ between a run and its resume.
RESUMABLE_CHANGES = {"out", "resume", "max_steps", "checkpoint_every", "log_every", "num_workers", "data_root",
                     "download", "devices", "num_nodes", "strategy", "accelerator", "compile", "eval_every"}


class RunDir:
    """A run's directory. It appears with the run's first file (config.json, written once data, models and
    any resumed checkpoint have loaded), so a run that fails to start leaves no empty folder behind."""

    def __init__(self, out: str, workload: str, write: bool = True, broadcast=None):
        """`broadcast` (e.g. fabric.broadcast) hands every rank rank 0's value, so that all ranks of a
        multi-process run agree on the default directory, which is named by the clock."""
        out = out or f"runs/{workload}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.path = Path(broadcast(out) if broadcast is not None else out)
        self.write = write  # False on every rank but 0
        self.started = time.perf_counter()
        if write:
            _check_writable(self.path)

    def _create(self) -> None:
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoints" / "last.ckpt"

    @property
    def best_checkpoint(self) -> Path:
        """The checkpoint of the best evaluation so far (the workloads that evaluate during training)."""
        return self.path / "checkpoints" / "best.ckpt"

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
        return {**peak, **cuda_peak()}

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
            print(f"Resumed {self.path} from step {step}", flush=True)
            kept = [r for r in self.metrics() if r["step"] <= step]
            self._create()  # resumed into a new --out
            with open(self.path / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def save_plain(self, state: dict, path: Path | None = None) -> None:
        """The plain variant's checkpoint of `state` (at `path`, default last.ckpt), written by rank 0 (the
        process that writes the run)."""
        if self.write:
            save_plain(path or self.checkpoint, state)

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


def cuda_peak() -> dict:
    """{"peak_cuda_mb": the CUDA allocator's peak so far} once this process has used CUDA, else {}."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
    return {}


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
    """`--resume` takes a run directory or a checkpoint: a file, or a directory (DeepSpeed writes those)."""
    path = Path(resume)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints" / "last.ckpt"
    previous = path.with_name(f".{path.name}.old")  # a DeepSpeed save killed between its two renames
    if not path.exists() and previous.is_dir():
        return previous
    if not path.exists():
        raise ValueError(f"--resume {resume}: no checkpoint at {path}")
    return path


def check_resume_config(checkpoint: Path, config) -> None:
    """Refuse to resume a run whose config.json differs in a field that changes what is computed."""
    saved_path = checkpoint.parent.parent / "config.json"
    if not saved_path.is_file():
        return  # a checkpoint copied out of its run directory: the model's shapes are still checked on load
    # a flag the saved run predates counts as the value it ran with (the config's saved_before); a config may
    # compare values by what they stand for (resume_comparable: the GAN's --native-size auto as a side in px)
    saved = {**getattr(config, "saved_before", {}), **json.loads(saved_path.read_text())}
    current = dataclasses.asdict(config)
    comparable = getattr(config, "resume_comparable", None)
    if comparable:
        saved, current = comparable(saved), comparable(current)
    differ = [f"{key} (checkpoint {saved[key]!r}, now {current[key]!r})" for key in current
              if key in saved and key not in RESUMABLE_CHANGES and saved[key] != current[key]]
    if saved.get("lr_schedule") == "cosine" and saved.get("max_steps") != current["max_steps"]:
        differ.append(f"max_steps (checkpoint {saved['max_steps']!r}, now {current['max_steps']!r}), where the "
                      f"cosine schedule ends")
    if differ:
        raise ValueError("cannot resume: the checkpoint's run used other settings for " + ", ".join(differ) +
                         ". Pass the same flags, or start a new run.")


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

    def report(self, run: "RunDir", step: int) -> dict:
        """After the checkpoint of a stop: say so on rank 0, and end the run (exit 130 after Ctrl-C)."""
        if run.write:
            print(f"Stopped by {self.reason} at step {step}; the checkpoint is saved. Resume with "
                  f"--resume {run.path}", flush=True)
        if self.reason == "SIGINT":
            sys.exit(130)
        return {}


def _last_good(checkpoint: Path) -> str:
    if checkpoint.exists():
        return f"The last good checkpoint is {checkpoint}: resume from it with a lower learning rate or another seed."
    return "No checkpoint had been written yet: start again with a lower learning rate or another seed."


def check_weights(state: dict, step: int, checkpoint: Path) -> None:
    """Refuse to write a checkpoint over a good one when an update left NaN or infinite weights (this
    process's shard of them, under a sharding strategy: the other processes then stop with it)."""
    for name, value in state.items():
        for param in getattr(value, "parameters", lambda: ())():
            if hasattr(param, "ds_tensor"):  # ZeRO-3: `param` is an empty placeholder; the shard is ds_tensor
                local = param.ds_tensor
            else:
                local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(local.detach().isfinite().all()):
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

    def __init__(self, config, state: dict, run: RunDir, stop: StopRequests, name: str, examples_per_step: int,
                 loggers=()):
        """`examples_per_step`: what one step trains on across all processes (images, or tasks for MAML), for
        the throughput in each record. `loggers`: objects with Lightning's `log_metrics(metrics, step)` and
        `finalize(status)` (the wrapped scripts pass core.loggers'), which get every record that goes to
        metrics.jsonl."""
        self.config, self.state, self.run, self.stop, self.loggers = config, state, run, stop, list(loggers)
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
            for logger in self.loggers:
                logger.log_metrics(record, step=self.state["step"])
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
        for logger in self.loggers:
            logger.finalize("stopped" if self.stop.reason else "success")
        check_weights(self.state, self.state["step"], self.run.checkpoint)


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
    """Restore what save_plain wrote into `state` in place (weights_only: nothing in the file is executed).
    It also reads the one-file checkpoints of the wrapped scripts (single and ddp runs), whose optimizer state
    is keyed by parameter name, and the file `python -m core.convert` makes of any other checkpoint."""
    if path.is_dir():
        raise ValueError(f"--resume {path}: a sharded (fsdp) or DeepSpeed checkpoint directory, which the plain "
                         f"scripts do not read. Make one file of it first: python -m core.convert {path} plain.ckpt, "
                         f"then --resume plain.ckpt")
    saved = torch.load(path, map_location=device, weights_only=True)
    if saved.get("format") == "core-checkpoint":  # written by a wrapped script's fabric.save
        saved = saved["state"]
    for key, value in state.items():
        if not hasattr(value, "load_state_dict"):
            state[key] = saved[key]
        elif isinstance(value, torch.optim.Optimizer):
            entry = saved[key].get("optimizer", saved[key])  # a wrapped run's entry also holds its loss scale
            value.load_state_dict(positional_optimizer_state(entry))
        else:
            getattr(value, "module", value).load_state_dict(saved[key])


def positional_optimizer_state(state: dict) -> dict:
    """An optimizer state dict keyed by parameter name (what core saves) as torch.optim numbers it: by the
    position of each parameter in the optimizer's groups, which the same script builds in the same order."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    if not all(isinstance(name, str) for name in names):
        return state
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}
