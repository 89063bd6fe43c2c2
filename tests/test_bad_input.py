"""Generated bad input (issue #41): every flag of the six training scripts, read from their config dataclasses,
and core.convert's SOURCE and TARGET, drawn as wrong types, zero, negative, huge and empty values, and as paths
that are a file, a folder, missing, unreadable, a run of another workload, a truncated or garbage checkpoint.

A command runs normally (exit 0), or exits 2 with one line `python -m X: error: ...` that names the flag or the
path and changes nothing in its working directory; never a traceback. It runs in this process as `python -m`
would (runpy, sys.argv, the run directory's at-exit work at its end), in a fresh directory holding the files it
names; a failing case prints as its command line.
"""
import dataclasses
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoencoder.config import Config as AutoencoderConfig
from benchmarks.workloads import WORKLOADS
from common.config import merge
from core.cli import FabricFlags
from core.strategies import STRATEGIES, SingleDevice, refusal
from gan.config import Config as GanConfig
from metalearn.config import Config as MetalearnConfig
from tests.conftest import built_once
from tests.in_process import run_module

CONFIGS = {"gan": GanConfig, "autoencoder": AutoencoderConfig, "metalearn": MetalearnConfig}
MODULES = [f"{workload}.{variant}" for workload in CONFIGS for variant in ("train", "train_torch")]
TYPES = ["abc", "1.5", "nan", "inf", ""]  # a number's wrong types, refused by argparse (1.5: a float's right one)
EDGES = ["0", "-1", str(10**12)]  # zero, negative, huge: refused, where they are, by the flag's own check
WORDS = ["", "abc", "0", "-1", str(10**12), "auto"]
PATH_FLAGS = ("out", "resume", "data_root")
FILES = ["", "file.txt", "folder", "missing", "unreadable", "garbage.ckpt"]  # made for every command
RUNS = [f"run-{module}" for module in MODULES]  # a tiny real run of each script (`made`)
LONG = ("max_steps", "inner_steps", "accumulate")  # 10**12 of them asks for a long run, not a wrong one
QUICK = settings(max_examples=70, deadline=None, derandomize=True, database=None)  # about 40 s in all
THOROUGH = settings(QUICK, max_examples=200)  # most values, alone and in pairs: about 1.5 minutes


@dataclasses.dataclass
class Command:
    module: str
    args: list[str]
    named: list[str]  # its error line names one of them: a drawn flag, or a value it was given

    def __repr__(self):  # the command line that replays it
        return shlex.join(["python", "-m", self.module, *self.args])

    def _repr_pretty_(self, printer, cycle):  # (how hypothesis prints a failing case)
        printer.text(repr(self))


def baseline(module: str) -> dict[str, str]:
    """Tiny valid flags: a run takes about a second."""
    workload = WORKLOADS[module.split(".")[0]]
    values = {**workload.generated_data, **workload.small, "max_steps": 2, "log_every": 1}
    if module.endswith(".train"):
        values.update(accelerator="cpu", devices=1)
    return {"--" + name.replace("_", "-"): str(value) for name, value in values.items()}


def flat(flags: dict[str, str]) -> list[str]:
    return [item for flag_and_value in flags.items() for item in flag_and_value]


def left_out(module: str, name: str, value: str) -> bool:
    """Valid values that do not fit a one-second run in this process: a process group (ddp, fsdp, DeepSpeed, or
    several GPUs; a strategy the workload refuses stays), torch.compile (tens of seconds), a download, the GAN's
    digits (its first score trains a classifier: 30 s), a long run."""
    if name == "strategy":
        refused = value in STRATEGIES and refusal(value, "32-true", getattr(CONFIGS[module.split(".")[0]](), "needs", set)())
        return value in STRATEGIES and STRATEGIES[value][0] is not SingleDevice and not refused
    return (value in ("--compile", "--download") or name in LONG and value == str(10**12)
            or module.startswith("gan.") and (name, value) == ("dataset", "digits")
            or (name, value) == ("devices", "auto") and torch.cuda.device_count() > 1)


def options(module: str) -> dict[str, st.SearchStrategy[tuple[str, ...]]]:
    """For each field of the script's config, its arguments: a kind of value, then a value of that kind (so the
    values a flag's own check refuses come as often as the wrong types argparse refuses)."""
    workload, variant = module.split(".")
    config = merge(CONFIGS[workload], FabricFlags) if variant == "train" else CONFIGS[workload]
    runs = [*RUNS, f"run-{module}-truncated", f"run-{module}-garbage", f"{module}.ckpt"]
    drawn = {}
    for field in dataclasses.fields(config):
        flag = "--" + field.name.replace("_", "-")
        kinds = [FILES, runs] if field.name in PATH_FLAGS else [TYPES, EDGES] if field.type in (int, float) else [WORDS]
        kinds = [[(flag, str(value)) for value in kind] for kind in [field.metadata.get("choices", ()), *kinds]]
        if field.type is bool:  # both are valid
            kinds = [[(flag,), ("--no-" + flag[2:],)]]
        kinds = [[value for value in kind if not left_out(module, field.name, value[-1])] for kind in kinds]
        drawn[field.name] = st.sampled_from([kind for kind in kinds if kind]).flatmap(st.sampled_from)
    return drawn


@st.composite
def commands(draw, module: str) -> Command:
    """The baseline with one or two flags drawn."""
    table = options(module)
    names = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=2, unique=True))
    drawn = [draw(table[name]) for name in names]
    flags = {"--" + name.replace("_", "-") for name in names}
    told = [value[-1] for value in drawn if len(value[-1]) > 3]  # long enough to name the input: a path, a dataset
    args = flat({flag: value for flag, value in baseline(module).items() if flag not in flags})
    return Command(module, args + [item for value in drawn for item in value], [*flags, *names, *told])


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """run-MODULE: a tiny real run of each script; MODULE.ckpt: its checkpoint alone; run-MODULE-truncated and
    run-MODULE-garbage: the run with its checkpoint cut in half, or replaced by text."""
    def build(root):
        for module in MODULES:
            status, stderr = run_module(module, [*flat(baseline(module)), "--out", f"run-{module}"], root)
            assert status == 0, stderr
            checkpoint = root / f"run-{module}" / "checkpoints" / "last.ckpt"
            shutil.copy(checkpoint, root / f"{module}.ckpt")
            for kind, text in (("truncated", checkpoint.read_bytes()[:checkpoint.stat().st_size // 2]),
                               ("garbage", b"not a checkpoint\n")):
                shutil.copytree(root / f"run-{module}", root / f"run-{module}-{kind}")
                (root / f"run-{module}-{kind}" / "checkpoints" / "last.ckpt").write_bytes(text)
    return built_once(tmp_path_factory, "bad-input-runs", build)  # once for the session's workers; copied, not used


def snapshot(work: Path) -> dict:
    """Every path under `work`: True for a folder, (size, modification time) for a file."""
    return {str(path.relative_to(work)): path.is_dir() or (path.stat().st_size, path.stat().st_mtime_ns)
            for path in work.rglob("*")}


def check(command: Command, made: Path) -> None:
    with tempfile.TemporaryDirectory() as name:
        work = Path(name)
        (work / "file.txt").write_text("a file\n")
        (work / "garbage.ckpt").write_bytes(b"not a checkpoint\n")
        (work / "folder").mkdir()
        (work / "unreadable").mkdir(mode=0)  # (root reads it all the same)
        for entry in made.iterdir():
            if any(arg == entry.name or arg.startswith(entry.name + "/") for arg in command.args):
                (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, work / entry.name)
        before = snapshot(work)
        try:
            status, stderr = run_module(command.module, command.args, work)
            after = snapshot(work)
        finally:
            (work / "unreadable").chmod(0o700)
    assert "Traceback" not in stderr, f"{command!r}\n{stderr}"
    changed = {path for path, _ in set(after.items()) ^ set(before.items())}
    if status == 0 and command.module == "core.convert":  # it writes TARGET, a file, and nothing else
        target = command.args[1]
        assert changed <= {target, *map(str, Path(target).parents)} and after[target] is not True, f"{command!r}"
    if status == 0 or status == 1 and f"python -m {command.module}: stopped: " in stderr:  # a legal value diverged
        return
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, f"{command!r} exited {status} with:\n{stderr}"
    assert lines[0].startswith(f"python -m {command.module}: error: "), f"{command!r}\n{stderr}"
    assert any(name in lines[0] for name in command.named), f"{command!r}: names none of {command.named}: {stderr}"
    assert not changed, f"{command!r} changed {sorted(changed)}"


@pytest.mark.parametrize("module", MODULES)
@QUICK
@given(data=st.data())
def test_a_script_runs_or_refuses_bad_flags_in_one_line(module, made, data):
    check(data.draw(commands(module)), made)


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
@THOROUGH
@given(data=st.data())
def test_a_script_runs_or_refuses_many_more_bad_flags(module, made, data):
    check(data.draw(commands(module)), made)


def conversions() -> st.SearchStrategy[Command]:
    """SOURCE: any path above or a run's checkpoints folder; TARGET: a new file, a file, a folder, a file in a
    missing or unreadable folder, empty, another run's checkpoint, or SOURCE itself."""
    sources = [*FILES, *RUNS, "run-gan.train/checkpoints",
               *(f"{run}-{kind}" for run in RUNS for kind in ("truncated", "garbage")), *(f"{m}.ckpt" for m in MODULES)]
    targets = ["plain.ckpt", "file.txt", "folder", "missing/plain.ckpt", "unreadable/plain.ckpt", "",
               "run-gan.train/checkpoints/last.ckpt"]
    return st.sampled_from(sources).flatmap(lambda source: st.sampled_from([*targets, source]).map(
        lambda target: Command("core.convert", [source, target], [source or "source", target or "target"])))


@THOROUGH
@given(command=conversions())
def test_convert_runs_or_refuses_bad_paths_in_one_line(made, command):
    check(command, made)
