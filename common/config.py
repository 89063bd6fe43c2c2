"""Configuration: one dataclass per workload, turned into an argparse parser with help on every flag.

Fields become kebab-case flags (`max_steps` -> `--max-steps`); `metadata={"help": ..., "choices": ...}`
gives the help text and allowed values; booleans become `--flag/--no-flag`. (A strategy that cannot run a
workload is refused by core, from what the workload's `needs()` says, with the reason.) Misuse exits
with status 2 and one line: `python -m gan.train: error: ...`.
"""
import argparse
import dataclasses
import errno
import math
import os
import shutil
import signal
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from common.loggers import LOGGERS, check_logger
from common.resume import resolve_run
from common.terminal import close_bars, keep_lines_whole


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one readable line and exit status 2, no usage dump
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its example commands one per line), and each flag's default after its
    help unless the default is empty."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or not action.option_strings or action.default in (None, "", argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def flag(default, help: str, **metadata):
    """A dataclass field with the help text (and optional choices) its flag shows."""
    return field(default=default, metadata={"help": help, **metadata})


def merge(*config_classes):
    """One dataclass with the fields of all of them (a workload's Config plus core's FabricFlags)."""
    if len(config_classes) == 1:
        return config_classes[0]
    return dataclasses.make_dataclass("TrainConfig", [], bases=tuple(reversed(config_classes)))


def parse(config_class, argv=None, prog=None, description=None):
    """Parse argv into a `config_class`; call its `check()` (if any) and turn ValueError into exit 2."""
    parser = _Parser(prog=prog, description=description, formatter_class=_HelpFormatter)
    for f in dataclasses.fields(config_class):
        name = "--" + f.name.replace("_", "-")
        kwargs = {"default": f.default, "help": f.metadata.get("help", "")}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if f.type in (bool, "bool"):
            parser.add_argument(name, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__)
        if f.metadata.get("type"):
            kind = f.metadata["type"]
        parser.add_argument(name, type=kind or str, **kwargs)
    config = config_class(**vars(parser.parse_args(argv)))
    for action in parser._actions:  # parsed again without defaults: what is left was on the command line
        action.default = argparse.SUPPRESS
    config.given = set(vars(parser.parse_args(argv)))  # (a resume takes the others from the run's config.json)
    if hasattr(config, "resume"):
        try:  # where it writes, what it resumes (and, on a resume, the flags not typed: the run's own)
            resolve_run(config, (prog or "").split(" -m ")[-1].split(".")[0])
        except ValueError as error:
            error_exit(prog, str(error))
        except OSError as error:  # a path the system refuses to look at (a name too long, a folder it may not list)
            error_exit(prog, f"cannot use {error.filename or 'the run directory'} ({error.strerror.lower()}); pass "
                             f"another --out or --resume")
    try:  # after resolve_run, so that the flags a resume restored are checked too
        if hasattr(config, "check"):
            config.check()
    except ValueError as error:
        parser.error(str(error))
    return config


def cli(main, *config_classes, prog: str, description: str = ""):
    """Run `main(config)` from the command line: bad input (flags, data, checkpoints: a ValueError or
    FileNotFoundError the suite's own code raises) exits with status 2 and one line, a diverged run (FloatingPointError) or a rank that
    waited past the collective timeout (TimeoutError) with 1 and one line (an error marked `every_rank`, which
    all ranks raised together, is said by rank 0 alone); anything else is a bug and keeps its traceback. SUITE_TRACEBACK=1 in the environment keeps the traceback of the one-line errors too. Before such an exit, `config.on_failure()` (where the config
    has one: core's flags) tells the launcher not to wait for the other ranks. Every message starts a line of its own
    beside the progress bar (common/terminal.py)."""
    keep_lines_whole()
    config = parse(merge(*config_classes), prog=prog, description=description)
    failing = getattr(config, "on_failure", lambda: None)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            return main(config)
        finally:
            close_bars()  # before any message: the bar's last state above it, the message the last line
    except (ValueError, FileNotFoundError) as error:
        if os.environ.get("SUITE_TRACEBACK", "0") not in ("", "0") or not raised_by_the_suite(error):
            raise
        failing()
        if getattr(error, "every_rank", False) and int(os.environ.get("RANK", "0")) != 0:
            sys.exit(2)  # every rank raised it together (an agreed verdict): rank 0 says it, once
        error_exit(prog, str(error))
    except (FloatingPointError, TimeoutError) as error:  # diverged, or waited too long: no traceback needed
        failing()
        sys.stderr.write(f"{prog}: stopped: {error}\n")
        sys.exit(1)
    except OSError as error:  # (after TimeoutError, one of them)
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or os.environ.get("SUITE_TRACEBACK", "0") not in ("", "0"):
            raise
        failing()  # a log, a sample or a plot that found the disk full (a checkpoint says so itself, above)
        where = error.filename or getattr(config, "out", "") or "the run directory"
        free = shutil.disk_usage(where if os.path.isdir(where) else os.path.dirname(where) or ".").free / 2**20
        error_exit(prog, f"no space left on the disk writing {where} ({free:.1f} MB free): free space there, or "
                         f"move the run directory, then resume from its last checkpoint")
    except KeyboardInterrupt:  # Ctrl-C outside the training loop, which turns it into a checkpointed stop
        failing()
        sys.stderr.write(f"{prog}: interrupted outside the training loop; nothing after the last checkpoint "
                         f"was saved\n")
        sys.exit(130)
    finally:  # the loop's stop handlers (StopRequests) end with main, also when it raised
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


SUITE = Path(__file__).resolve().parent.parent  # the folder that holds core, common and the workloads
PACKAGES = ("core", "common", "gan", "autoencoder", "metalearn", "benchmarks")
LIBRARIES = tuple(str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("stdlib", "purelib", "platlib"))


def raised_by_the_suite(error: BaseException) -> bool:
    """Whether `error` was raised by the suite's own code (a check of its input: one line for the user) or a
    user's code around it, rather than by torch, another library or the standard library from inside a step (a
    bug, whatever its class: it keeps its traceback)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    if where.is_relative_to(SUITE) and where.relative_to(SUITE).parts[0] in PACKAGES:
        return True
    return not str(where).startswith(LIBRARIES)


def error_exit(prog: str, message: str):
    """Report bad input found after parsing (a missing data root, an incompatible resume) like argparse."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.exit(2)


def usable_cores() -> int:
    """The cores this process may run on (what taskset, SLURM or a container left it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class RunConfig:
    """The flags every workload shares, under the same names."""
    seed: int = flag(0, "random seed (weights, data order, noise)")
    max_steps: int = flag(1000, "optimizer steps to train for (meta-iterations for metalearn)")
    batch_size: int = flag(64, "examples per step on each process")
    out: str = flag("", "run directory (metrics, checkpoints, plots); a directory that holds a run is written only by "
                        "--resume; default: the resumed run's, else a new runs/<workload>-<time>[-N]")
    resume: str = flag("", "continue a run exactly, with its own flags: a run directory, or a checkpoint (a file; "
                           "fsdp, DeepSpeed: a folder); auto: the newest checkpoint in --out, or a new run there")
    checkpoint_every: int = flag(500, "save checkpoints/last.ckpt every N steps, and at the end (0: only at the end)")
    keep_checkpoints: int = flag(2, "checkpoints kept, the newest included (checkpoints/step-N.ckpt, hard links of "
                                    "last.ckpt: no second copy of its bytes); a resume from the run skips one that "
                                    "fails its checksums. 1: last.ckpt alone")
    dataset: str = flag("digits", "dataset name")
    data_root: str = flag("data", "folder that holds (or receives, with --download) the dataset files")
    download: bool = flag(False, "download the dataset into --data-root if it is missing (needs internet)")
    num_workers: int = flag(0, "DataLoader worker processes")
    log_every: int = flag(50, "write metrics every N steps")
    accumulate: int = flag(1, "micro-batches of --batch-size per optimizer step (gradient accumulation): the same "
                              "update as one batch N times larger, with the activation memory of one micro-batch")
    lr_schedule: str = flag("constant", "learning rate over the run: constant, or cosine (a linear warm-up over "
                                        "--warmup-steps, then a cosine decay to 0 at --max-steps)",
                            choices=("constant", "cosine"))
    warmup_steps: int = flag(0, "steps of linear learning-rate warm-up (with --lr-schedule cosine)")
    compile: bool = flag(False, "torch.compile the models (the first steps compile: tens of seconds)")
    logger: str = flag("csv", "where the log records go besides metrics.jsonl: csv (metrics.csv in the run directory), "
                              "tensorboard (tensorboard/ in it; needs the tensorboard extra), or none", choices=LOGGERS)

    def check(self):
        for name in (f.name for f in dataclasses.fields(self)):  # every float flag: a workload's and core's too
            if isinstance(getattr(self, name), float) and not math.isfinite(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        self.check_at_least(1, "max_steps", "batch_size", "accumulate", "log_every")  # log_every: the loss check's too
        self.check_at_least(0, "checkpoint_every", "num_workers", "warmup_steps")
        self.check_at_least(1, "keep_checkpoints")
        cores = usable_cores()
        if self.num_workers > 4 * cores:  # torch warns above one per core; more than 4 per core cannot pay
            raise ValueError(f"--num-workers {self.num_workers}: each worker is a process, and this process may use "
                             f"{cores} cores; pass at most {4 * cores} (one per core is usual)")
        if self.warmup_steps and self.lr_schedule == "constant":
            raise ValueError("--warmup-steps is part of --lr-schedule cosine; pass --lr-schedule cosine too")
        check_logger(self.logger)
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be less than --max-steps ({self.max_steps})")

    def check_at_least(self, least, *names: str) -> None:
        for name in names:
            if getattr(self, name) < least:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(self, name)}")

    @staticmethod
    def check_fits(tensors: dict[str, int]) -> None:
        """Refuse sizes that cannot fit in this machine's memory, before anything starts. `tensors` maps the flags
        that size a tensor to the float32 elements it has at least, so that a refused run could never have run."""
        if not hasattr(os, "sysconf"):
            return
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        for flags, elements in tensors.items():
            if 4 * elements > memory:
                raise ValueError(f"{flags}: one tensor of at least {4 * elements / 2**30:.3g} GiB, more than this "
                                 f"machine's {memory / 2**30:.0f} GiB of memory; pass smaller values")
