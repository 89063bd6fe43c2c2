"""Which run a command writes and continues, and with which flags: one rule, applied by the command line
(`resolve_run`) before anything starts.

- `--out DIR` when given;
- else the run directory that `--resume` points into (`RUN`, `RUN/checkpoints/last.ckpt`, ...);
- else a new directory `runs/<workload>-<time>`, `-2`, `-3`, ... (claimed by `RunDir`).

A directory that holds a run is written only by a run that resumes it. `--resume auto` continues from the
newest checkpoint in `--out` if there is one and starts fresh there if not: what a restarted job (torchrun
`--max-restarts`, SLURM `--requeue`) passes every time. A resumed run keeps the flags it was started with,
except those given again on the command line (a changed flag that changes what is computed is refused).
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

from common.rundir import LAST, holds_run, kept_checkpoints

# Fields that do not change what is trained: they may differ between a run and its resume. Every other
# field given on a resume's command line must equal the run's (check_resume_config).
RESUMABLE_CHANGES = {"out", "resume", "max_steps", "checkpoint_every", "keep_checkpoints", "log_every", "num_workers",
                     "data_root", "download", "devices", "num_nodes", "strategy", "accelerator", "compile",
                     "eval_every", "logger", "sample_every", "eval_samples", "eval_tasks", "eval_queries",
                     "collective_timeout", "save_in_background"}
# Fields a resume does not take from the run's config.json: its own destination and source.
NOT_RESTORED = {"out", "resume"}


class NoCheckpoint(ValueError):
    """--resume found no checkpoint where it looked."""


def resolve_run(config, workload: str | None = None) -> None:
    """Apply the one rule (module docstring) to `config` in place: `config.out` becomes the run directory
    ("" for a new default one, named by RunDir) and `config.resume` the checkpoint to load ("" for none).
    A resumed run's flags not given on the command line (`config.given`) come from its config.json. Bad
    input raises ValueError with one line that says what to pass instead."""
    out = Path(config.out) if config.out else None
    auto = config.resume == "auto"
    recover = getattr(config, "recover_checkpoint", None)  # the wrapped scripts' (core's flags)
    verify = getattr(config, "verify_checkpoint", None)  # the same: a checkpoint's checksums
    if auto:
        if out is None:
            raise ValueError("--resume auto continues the run in --out, so it needs one: pass --out DIR, the same "
                             "on every restart")
        found = latest_checkpoint(out, recover, verify)
        if found is None:
            _say(f"--resume auto: no checkpoint in {out} yet; starting the run there")
        config.resume = str(found) if found else ""
    elif config.resume:
        checkpoint = resume_path(config.resume, recover, verify)
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


def latest_checkpoint(out: Path, recover=None, verify=None) -> Path | None:
    """The checkpoint a run in `out` would continue from, or None when it has none yet."""
    if not (out / "checkpoints").is_dir():
        return None
    try:
        return resume_path(str(out), recover, verify)
    except NoCheckpoint:
        return None


def resume_path(resume: str, recover=None, verify=None) -> Path:
    """`--resume` takes a run directory or a checkpoint: a file, or a directory (fsdp and DeepSpeed write those).
    `recover(path)`, where the script's saving has one (the wrapped scripts: core's), first puts back a checkpoint
    that a save interrupted mid-way left elsewhere. From a run directory, `verify(path)` (the wrapped scripts: the
    problems core's checksums find) picks the newest of last.ckpt and the kept checkpoints that passes, saying
    which were skipped and why; a checkpoint named itself is checked when it loads."""
    path = Path(resume)
    run = path if (path / "checkpoints").is_dir() else path.parent if path.name == "checkpoints" and \
        path.is_dir() else None
    if run is not None:
        path = run / "checkpoints" / LAST
    if recover is not None:
        recover(path)
    if run is not None and verify is not None:
        return _newest_that_passes(resume, [path] + [kept for _, kept in reversed(kept_checkpoints(run))], verify)
    if not path.exists():
        raise NoCheckpoint(f"--resume {resume}: no checkpoint at {path}")
    return path


def _newest_that_passes(resume: str, candidates: list[Path], verify) -> Path:
    skipped = []
    for path in candidates:
        if not path.exists():
            continue
        found = verify(path)
        if not found:
            if skipped:
                _say(f"[resume] skipped {'; '.join(skipped)}: resuming from {path}", stderr=True)
            return path
        skipped.append(f"{path.name} ({found[0]}{f'; and {len(found) - 1} more' if len(found) > 1 else ''})")
    if not skipped:
        raise NoCheckpoint(f"--resume {resume}: no checkpoint at {candidates[0]}")
    raise ValueError(f"--resume {resume}: every checkpoint of the run changed after it was saved: "
                     f"{'; '.join(skipped)}; start a new run")


def run_of(checkpoint: Path) -> Path | None:
    """The run directory a checkpoint belongs to (RUN for RUN/checkpoints/NAME), or None outside one."""
    parent = Path(os.path.abspath(checkpoint)).parent if checkpoint.parent.name != "checkpoints" else checkpoint.parent
    return parent.parent if parent.name == "checkpoints" and (parent.parent / "config.json").is_file() else None


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
    precision = saved.get("precision", "32-true")
    if "precision" not in current and precision not in ("32-true", "32"):  # a plain script resuming a wrapped run
        _say(f"[resume] the run trained in --precision {precision}; this script computes in float32 from here on, "
             f"so the rest of the run differs from the one it would have been (resume it with the wrapped script "
             f"to keep {precision})", stderr=True)


def _say(message: str, stderr: bool = False) -> None:
    """Print once per run: on the process that will be rank 0 (before launch, the only one)."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        print(message, flush=True, file=sys.stderr if stderr else sys.stdout)
