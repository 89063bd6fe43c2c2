"""The run directory: the files a run keeps there, written by rank 0.

A run directory holds `config.json`, `metrics.jsonl` (one JSON object per log step), `summary.json`,
`checkpoints/last.ckpt`, `--logger`'s files and the workload's plots. Which directory a run writes and what it
resumes from is decided before anything starts, in `common/resume.py`; a new default one is claimed here, so that
two runs started in the same second never share one.
"""
import atexit
import dataclasses
import json
import os
import sys
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from common.files import atomic_write
from common.loggers import make_loggers

LAST = "last.ckpt"  # the newest checkpoint of a run, in RUN/checkpoints/


def _new_directory(workload: str) -> Path:
    """Create and return runs/<workload>-<time>[-N], a name no other run holds (mkdir is atomic)."""
    stem = Path("runs") / f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not stem.parent.exists():
        stem.parent.mkdir(parents=True, exist_ok=True)
        atexit.register(_remove_if_empty, stem.parent)  # (atexit runs last-in first: after the run's own)
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
    """A run's directory, written by rank 0 (`write`). An --out appears with the run's first file (config.json,
    written once data, models and any resumed checkpoint have loaded), claimed atomically for a new run; a default
    directory is claimed at once and removed again if the run fails before writing to it."""

    def __init__(self, out: str, workload: str, write: bool = True, collectives=None, resume: str = ""):
        """`out`: the run directory resolve_run chose ("" for a new default one). `collectives`: an object with
        Fabric's `broadcast` and `all_reduce` (the Fabric), so that all ranks agree on a default name, on seeing
        the run directory and on `resume`, the checkpoint resolve_run found (each process looked for itself: a
        node that does not see the run directory would start afresh while the others resume)."""
        self.claim = write and bool(out) and not resume  # a new run in a named --out (a default one: by its name)
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
        self.keep = 1  # checkpoints kept (--keep-checkpoints), from start() on
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.loggers = []  # --logger's (common/loggers.py), made by start

    def _create(self) -> None:
        (self.path / "checkpoints").mkdir(parents=True, exist_ok=True)

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoints" / LAST

    def keep_checkpoint(self, step: int, after=None) -> None:
        """After a save of `checkpoint` at `step` (rank 0): keep it as checkpoints/step-STEP.ckpt too, and remove
        the oldest kept ones beyond --keep-checkpoints, so that a damaged newest checkpoint is not the run's only
        one. Hard links: no second copy of the bytes (a later save writes last.ckpt anew, leaving these whole).
        `after`: the Future of a background save: kept once it is written, in its thread (the next save waits for
        that too), not at all if it failed (the next save or the end of the run raises that)."""
        if not self.write or self.keep <= 1:
            return
        if after is not None:
            after.add_done_callback(lambda saved: self._keep_written(step, saved))
            return
        kept = self.checkpoint.with_name(f"step-{step:08d}.ckpt")
        staging = kept.with_name(f".{kept.name}.tmp")
        _remove(staging)
        _link(self.checkpoint, staging)
        _remove(kept)
        os.replace(staging, kept)
        for _, old in kept_checkpoints(self.path)[:-self.keep]:
            _remove(old)

    def _keep_written(self, step: int, saved) -> None:
        if saved.exception() is not None:
            return
        try:
            self.keep_checkpoint(step)
        except OSError as error:  # in the writer thread, which would only log it: said, and the run goes on
            print(f"[run] could not keep {self.checkpoint} as step {step} ({error}); last.ckpt is whole.",
                  file=sys.stderr, flush=True)

    @property
    def best_checkpoint(self) -> Path:
        """The checkpoint of the best evaluation so far (the workloads that evaluate during training)."""
        return self.path / "checkpoints" / "best.ckpt"

    def start(self, config, step: int) -> None:
        """Once any checkpoint has loaded (`step`: where the run goes on): say what was resumed, keep the
        metrics up to `step` (a record after it belongs to steps that will run again), write config.json."""
        self.keep = getattr(config, "keep_checkpoints", 1)
        if not self.write:
            return
        if config.resume:
            print(f"Resumed from {config.resume} at step {step}, writing to {self.path}", flush=True)
        if self.claim:
            _claim(self.path)
        self._create()
        kept = [r for r in self.metrics() if r["step"] <= step]
        if (self.path / "metrics.jsonl").exists():  # created by the first record, not before: a run shows it
            with open(self.path / "metrics.jsonl", "w") as f:  # has trained once metrics.jsonl is there
                f.writelines(json.dumps(r) + "\n" for r in kept)
        self.write_json("config.json", {"workload": self.workload, **dataclasses.asdict(config)})
        (self.path / CLAIM).unlink(missing_ok=True)  # config.json holds the directory for this run from now on
        self.loggers = make_loggers(config.logger, self.path, kept, step)  # the same records, also cut at `step`

    def log(self, record: dict) -> None:
        """Append one record ({"step": N, ...}) to metrics.jsonl, stamped with the seconds since the run (or its
        resume) started, `time` on the clock and `cpu` this process's CPU time (user + system, all its threads),
        and hand it to every logger."""
        if self.write:
            self._create()
            record = {**record, "time": round(time.perf_counter() - self.started, 4),
                      "cpu": round(time.process_time() - self.cpu_started, 4)}
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
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / f".rank-0-{token}").touch()
        except OSError as error:  # what _check_writable could not foresee (a name too long, a filesystem that changed)
            raise ValueError(f"cannot write to the run directory {path} ({error.strerror.lower()}); pass a writable "
                             f"--out") from error
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


def kept_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints keep_checkpoint kept in `run`, oldest first."""
    found = []
    for path in (Path(run) / "checkpoints").glob("step-*.ckpt"):
        number = path.name[len("step-"):-len(".ckpt")]
        if number.isdigit():
            found.append((int(number), path))
    return sorted(found)


def _link(source: Path, target: Path) -> None:
    """`target` as a hard link of the file `source`, or a directory of hard links of a directory's files (a copy
    where the filesystem has no hard links)."""
    source, target = Path(source), Path(target)
    if source.is_dir():
        shutil.copytree(source, target, copy_function=_link)
        return
    try:
        os.link(source, target)
    except OSError:  # no hard links here (some network and FUSE filesystems): a copy
        shutil.copy2(source, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


CLAIM = ".starting"  # in a named --out while a new run writes its first file there


def _claim(path: Path) -> None:
    """Take `path` for a new run, atomically (O_EXCL), before its first file: of two runs started at once with the
    same new --out, which both passed resolve_run's check before either wrote a file, the second is refused. The
    claim lasts until config.json is written (from then on holds_run refuses a new run there); a claim whose
    process is gone (killed in between) is taken over."""
    path.mkdir(parents=True, exist_ok=True)
    claim = path / CLAIM
    for _ in range(3):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                holder = claim.read_text()
            except FileNotFoundError:  # its process gave it up in between: try again
                continue
            host, _, pid = holder.rpartition(" ")
            if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
                who = f"process {pid} on {host}" if holder else "a process that has not written its name yet"
                raise ValueError(f"--out {path}: another run is starting there ({who}); pass a new --out (if no "
                                 f"such process runs any more, delete {claim})") from None
            claim.unlink(missing_ok=True)  # its process is gone
    else:  # every try met a claim that went away or was stale: others keep starting there
        raise ValueError(f"--out {path}: other runs keep starting there; pass a new --out")
    os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
    os.close(fd)
    if holds_run(path):  # another run started there since resolve_run's check, and wrote its config.json
        claim.unlink()
        raise ValueError(f"--out {path} already holds a run ({', '.join(holds_run(path))}), started since this one "
                         f"was; pass a new --out")


def holds_run(path: Path) -> list[str]:
    """The files that make `path` a run's directory (empty: it holds none)."""
    found = [name for name in ("config.json", "metrics.jsonl", "summary.json") if (path / name).exists()]
    if (path / "checkpoints").is_dir() and any((path / "checkpoints").iterdir()):
        found.append("checkpoints/")
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_writable(path: Path) -> None:
    """Refuse an --out that cannot be created or written, without creating anything yet."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        reason = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = f"{existing} permission denied"
    else:  # os.access says yes to root everywhere: a read-only filesystem, /sys or /proc say no
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".writable-", dir=existing))
            return
        except OSError as error:
            reason = f"{existing}: {error.strerror.lower()}"
    raise ValueError(f"cannot write to the run directory {path} ({reason}); pass a writable --out")
