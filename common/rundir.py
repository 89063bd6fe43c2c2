"""The run directory: where a run writes, what it resumes from, and the files it keeps.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object per log step), `summary.json`,
`checkpoints/last.ckpt` and the workload's plots. One rule decides where a run writes (`resolve_run`,
called by the command line before anything starts):

- `--out DIR` when given;
- else the run directory that `--resume` points into (`RUN`, `RUN/checkpoints/last.ckpt`, ...);
- else a new directory `runs/<workload>-<time>`, `-2`, `-3`, ... created at once, so that two runs
  started in the same second never share one.

A directory that holds a run is written only by a run that resumes it. `--resume auto` continues from the
newest checkpoint in `--out` if there is one and starts fresh there if not: what a restarted job (torchrun
`--max-restarts`, SLURM `--requeue`) passes every time. A resumed run keeps the flags it was started with,
except those given again on the command line (a changed flag that changes what is computed is refused).
"""
import atexit
import dataclasses
import json
import os
import socket
import time
from pathlib import Path

import torch

from common.files import atomic_write
from common.loggers import make_loggers

# Fields that do not change what is trained: they may differ between a run and its resume. Every other
# field given on a resume's command line must equal the run's (check_resume_config).
RESUMABLE_CHANGES = {"out", "resume", "max_steps", "checkpoint_every", "log_every", "num_workers", "data_root",
                     "download", "devices", "num_nodes", "strategy", "accelerator", "compile", "eval_every",
                     "logger", "sample_every", "eval_samples", "eval_tasks", "eval_queries",
                     "collective_timeout"}
# Fields a resume does not take from the run's config.json: its own destination and source.
NOT_RESTORED = {"out", "resume"}
LAST = "last.ckpt"


def resolve_run(config, workload: str | None = None) -> None:
    """Apply the one rule (module docstring) to `config` in place: `config.out` becomes the run directory
    ("" for a new default one, named by RunDir) and `config.resume` the checkpoint to load ("" for none).
    A resumed run's flags not given on the command line (`config.given`) come from its config.json. Bad
    input raises ValueError with one line that says what to pass instead."""
    out = Path(config.out) if config.out else None
    auto = config.resume == "auto"
    recover = getattr(config, "recover_checkpoint", None)  # the wrapped scripts' (core's flags)
    if auto:
        if out is None:
            raise ValueError("--resume auto continues the run in --out, so it needs one: pass --out DIR, the same "
                             "on every restart")
        found = latest_checkpoint(out, recover)
        if found is None:
            _say(f"--resume auto: no checkpoint in {out} yet; starting the run there")
        config.resume = str(found) if found else ""
    elif config.resume:
        checkpoint = resume_path(config.resume, recover)
        source = run_of(checkpoint)
        if out is None and source is None:
            raise ValueError(f"--resume {config.resume}: this checkpoint is not inside a run directory "
                             f"(RUN/checkpoints/), so there is no run to continue in; pass --out DIR for the "
                             f"resumed run")
        out = out or source
        config.resume = str(checkpoint)
    if out is not None and not auto and holds_run(out):
        held = ", ".join(holds_run(out))
        if not config.resume:
            raise ValueError(f"--out {out} already holds a run ({held}); continue it with --resume {out} (or "
                             f"--resume auto), or pass a new --out")
        source = run_of(Path(config.resume))
        if source is None or source.resolve() != out.resolve():
            raise ValueError(f"--out {out} already holds another run ({held}); pass a new --out for the run "
                             f"resumed from {config.resume}")
    config.out = str(out) if out is not None else ""
    if config.resume:
        saved = saved_config(run_of(Path(config.resume)), config)
        if workload and saved.get("workload", workload) != workload:
            raise ValueError(f"--resume {config.resume}: a checkpoint of the {saved['workload']} workload; resume it "
                             f"with python -m {saved['workload']}.train (or {saved['workload']}.train_torch)")
        restore_flags(config, run_of(Path(config.resume)))
        check_resume_config(Path(config.resume), config)


def latest_checkpoint(out: Path, recover=None) -> Path | None:
    """The checkpoint a run in `out` would continue from, or None when it has none yet."""
    try:
        return resume_path(str(out), recover) if (out / "checkpoints").is_dir() else None
    except ValueError:
        return None


def resume_path(resume: str, recover=None) -> Path:
    """`--resume` takes a run directory or a checkpoint: a file, or a directory (fsdp and DeepSpeed write those).
    `recover(path)`, where the script's saving has one (the wrapped scripts: core's), first puts back a checkpoint
    that a save interrupted mid-way left elsewhere."""
    path = Path(resume)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints" / LAST
    elif path.name == "checkpoints" and path.is_dir():  # RUN/checkpoints: its newest
        path = path / LAST
    if recover is not None:
        recover(path)
    if not path.exists():
        raise ValueError(f"--resume {resume}: no checkpoint at {path}")
    return path


def run_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint belongs to (RUN for RUN/checkpoints/NAME), or None outside one."""
    parent = Path(os.path.abspath(checkpoint)).parent if checkpoint.parent.name != "checkpoints" else checkpoint.parent
    return parent.parent if parent.name == "checkpoints" and (parent.parent / "config.json").is_file() else None


def holds_run(path: Path) -> list[str]:
    """The files that make `path` a run's directory (empty: it holds none)."""
    found = [name for name in ("config.json", "metrics.jsonl", "summary.json") if (path / name).exists()]
    if (path / "checkpoints").is_dir() and any((path / "checkpoints").iterdir()):
        found.append("checkpoints/")
    return found


def saved_config(run: Path | None, config) -> dict:
    """The settings the run in `run` was started with; a flag it predates counts as the value it ran with
    (the config's `saved_before`)."""
    if run is None:
        return {}
    return {**getattr(config, "saved_before", {}), **json.loads((run / "config.json").read_text())}


def restore_flags(config, run: Path | None) -> None:
    """Every flag not given on the command line takes the value the resumed run was started with."""
    given = getattr(config, "given", set())
    for key, value in saved_config(run, config).items():
        if hasattr(config, key) and key not in given and key not in NOT_RESTORED:
            setattr(config, key, value)


def check_resume_config(checkpoint: Path, config) -> None:
    """Refuse to resume a run whose config.json differs in a field that changes what is computed."""
    saved = saved_config(run_of(checkpoint), config)
    if not saved:
        return  # a checkpoint copied out of its run directory: the model's shapes are still checked on load
    current = dataclasses.asdict(config)
    comparable = getattr(config, "resume_comparable", None)  # values compared by what they stand for
    if comparable:
        saved, current = comparable(saved), comparable(current)
    differ = [f"{key} (checkpoint {saved[key]!r}, now {current[key]!r})" for key in current
              if key in saved and key not in RESUMABLE_CHANGES and saved[key] != current[key]]
    if saved.get("lr_schedule") == "cosine" and saved.get("max_steps") != current["max_steps"]:
        differ.append(f"max_steps (checkpoint {saved['max_steps']!r}, now {current['max_steps']!r}), where the "
                      f"cosine schedule ends")
    if differ:
        raise ValueError("cannot resume: the checkpoint's run used other settings for " + ", ".join(differ) +
                         ". Drop those flags (a resume keeps the run's own), or start a new run.")


def _say(message: str) -> None:
    """Print once per run: on the process that will be rank 0 (before launch, the only one)."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        print(message, flush=True)


def _new_directory(workload: str) -> Path:
    """Create and return runs/<workload>-<time>[-N], a name no other run holds (mkdir is atomic)."""
    stem = Path("runs") / f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    for number in range(1, 10_000):
        path = stem if number == 1 else stem.with_name(f"{stem.name}-{number}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        atexit.register(_remove_if_empty, path)  # a run that fails before its first file leaves nothing
        return path
    raise RuntimeError(f"no free run directory name under {stem.parent}; pass --out")


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # it holds the run's files


class RunDir:
    """A run's directory, written by rank 0 (`write`). An --out appears with the run's first file
    (config.json, written once data, models and any resumed checkpoint have loaded); a default directory is
    claimed at once and removed again if the run fails before writing to it."""

    def __init__(self, out: str, workload: str, write: bool = True, collectives=None, resume: str = ""):
        """`out`: the run directory resolve_run chose ("" for a new default one). `collectives`: an object with
        Fabric's `broadcast` and `all_reduce` (the Fabric), so that all ranks agree on a default name, on seeing
        the run directory and on `resume`, the checkpoint resolve_run found (each process looked for itself: a
        node that does not see the run directory would start afresh while the others resume)."""
        if write:
            if out:
                _check_writable(Path(out))
            else:
                out = str(_new_directory(workload))
        self.path = Path(collectives.broadcast(out) if collectives is not None else out)
        if collectives is not None:
            _check_shared(self.path, write, collectives)
            if not _everywhere(collectives, collectives.broadcast(resume) == resume):
                raise ValueError(f"the ranks found different checkpoints to resume from in {self.path} (this one: "
                                 f"{resume or 'none'}): the run directory must be on a filesystem every node sees")
        self.workload, self.write = workload, write  # write: False on every rank but 0
        self.started = time.perf_counter()
        self.loggers = []  # --logger's (common/loggers.py), made by start

    def _create(self) -> None:
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoints" / LAST

    @property
    def best_checkpoint(self) -> Path:
        """The checkpoint of the best evaluation so far (the workloads that evaluate during training)."""
        return self.path / "checkpoints" / "best.ckpt"

    def start(self, config, step: int) -> None:
        """Once any checkpoint has loaded (`step`: where the run goes on): say what was resumed, keep the
        metrics up to `step` (a record after it belongs to steps that will run again), write config.json."""
        if not self.write:
            return
        if config.resume:
            print(f"Resumed from {config.resume} at step {step}, writing to {self.path}", flush=True)
        self._create()
        kept = [r for r in self.metrics() if r["step"] <= step]
        if (self.path / "metrics.jsonl").exists():  # created by the first record, not before: a run shows it
            with open(self.path / "metrics.jsonl", "w") as f:  # has trained once metrics.jsonl is there
                f.writelines(json.dumps(r) + "\n" for r in kept)
        self.write_json("config.json", {"workload": self.workload, **dataclasses.asdict(config)})
        self.loggers = make_loggers(config.logger, self.path, kept, step)  # the same records, also cut at `step`

    def log(self, record: dict) -> None:
        """Append one record ({"step": N, ...}) to metrics.jsonl, stamped with the seconds since the run (or its
        resume) started, and hand it to every logger."""
        if self.write:
            self._create()
            record = {**record, "time": round(time.perf_counter() - self.started, 4)}
            with open(self.path / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            for logger in self.loggers:
                logger.log(record)

    def finalize(self) -> None:
        """The loggers' end of the run."""
        for logger in self.loggers:
            logger.close()

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
            atomic_write(self.path / name, lambda f: f.write(json.dumps(data, indent=2) + "\n"), mode="w")

    def metrics(self) -> list[dict]:
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

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


def _everywhere(collectives, holds: bool) -> bool:
    """True on every rank when `holds` is true on every rank: a decision all ranks take together."""
    return bool(collectives.all_reduce(torch.tensor(int(holds)), reduce_op="min"))


def _check_shared(path: Path, write: bool, collectives) -> None:
    """Every rank must see the run directory rank 0 writes: checkpoints are read on every rank, and under fsdp
    and DeepSpeed every rank writes its shard into it. Rank 0 leaves a marker there and the ranks say together
    whether each sees it: all stop at once, before any training, instead of at the first checkpoint."""
    token = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}" if write else None
    created = write and not path.exists()
    if write:
        path.mkdir(parents=True, exist_ok=True)
        (path / f".rank-0-{token}").touch()
    token = collectives.broadcast(token)
    seen = (path / f".rank-0-{token}").is_file()
    everywhere = _everywhere(collectives, seen)  # (every rank has looked before rank 0 removes the marker)
    if write:
        (path / f".rank-0-{token}").unlink()
        if created:
            path.rmdir()  # an --out appears with the run's first file
    if not everywhere:
        host = token.rsplit("-", 2)[0]
        where = "this process does not see" if not seen else "another node's process does not see"
        raise ValueError(f"{where} the run directory {path.resolve()} that rank 0 (on host {host}) writes: it must "
                         f"be on a filesystem every node sees (every rank reads the checkpoints, and under fsdp "
                         f"and deepspeed writes its shard there); pass an --out on shared storage")


def _check_writable(path: Path) -> None:
    """Refuse an --out that cannot be created or written, without creating anything yet."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    reason = ("is a file" if not existing.is_dir() else
              "permission denied" if not os.access(existing, os.W_OK | os.X_OK) else None)
    if reason:
        raise ValueError(f"cannot write to the run directory {path} ({existing} {reason}); pass a writable --out")
