"""Shared test set-up: one thread per process, a private classifier cache, helpers to run the scripts."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from common.resume import resolve_run
from core.seed import SEED_VARIABLE, WORKERS_VARIABLE
from tests.timings import Timings

ROOT = Path(__file__).resolve().parent.parent
# seconds: a deadline that catches a hang (a collective waits 30 minutes by default), never a busy machine; a test
# asserts what happened (a step, a line, a file), not how fast
HANG = 300
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--timings", type=Path, default=None, metavar="PATH",
                     help="write every test's CPU and wall seconds here (default: timings.json in pytest's basetemp); "
                          "python -m tests.timings PATH prints the top 20")


def pytest_configure(config):
    """DeepSpeed compiles its shared-memory op with ninja on first use (a minute or more) into torch's extension
    cache: build it once here, before any test's clock starts. pytest-xdist's controller runs this before it
    starts its workers; a worker finds it built."""
    config.pluginmanager.register(Timings(config.getoption("timings")), "suite-timings")
    if hasattr(config, "workerinput") or importlib.util.find_spec("deepspeed") is None:
        return
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    if any(cache.glob("**/deepspeed_shm_comm/*.so")):
        return
    subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"], cwd=ROOT,
                   capture_output=True, timeout=1800)  # a failed build shows in the DeepSpeed tests themselves


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def two_ranks():
    """`two_ranks(family)`: this session's long-lived 2-rank group of that strategy family (tests/group.py),
    started at its first case."""
    from tests.group import FAMILIES, Group

    groups = {}

    def group(family: str) -> Group:
        assert family in FAMILIES, f"a family of {FAMILIES}"
        return groups.setdefault(family, Group(family))
    yield group
    for started in groups.values():
        started.close()


def shared_root(tmp_path_factory) -> Path:
    """This session's temporary folder that every pytest-xdist worker sees (each worker's basetemp is inside it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def built_once(tmp_path_factory, name: str, build) -> Path:
    """A folder that `build(folder)` fills, built once per test session however many workers ask for it: the first
    builds it under a file lock, the others wait for it (at most 20 minutes) and reuse it, read-only. A failed build
    leaves nothing, so the next worker that asks builds it again and fails the same way."""
    folder = shared_root(tmp_path_factory) / f"built-{name}"
    done = folder.with_name(f"{folder.name}.done")  # beside the folder: its users list what is in it
    with FileLock(f"{folder}.lock", timeout=1200):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # one classifier cache for the session's workers (gan/score.py writes it atomically)
    monkeypatch.setenv("SUITE_CACHE", str(shared_root(tmp_path_factory) / "cache"))


@pytest.fixture(autouse=True)
def _seed_variables_restored():
    """seed_everything leaves its seed in os.environ (PL_GLOBAL_SEED, as Lightning's does) for the processes a
    launcher starts; a test's seed must not reach the processes a later test in this worker starts (the contract's
    DistributedSampler took seed 3 from an earlier test's seed_everything(3) and read other batches than plain)."""
    saved = {name: os.environ.get(name) for name in (SEED_VARIABLE, WORKERS_VARIABLE)}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# torchrun on 2 local processes; --standalone takes a free rendezvous port instead of the fixed 29500, which
# another test running at the same time (pytest -n 2) may hold
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run(args, timeout=240, check=True, env=None, **kwargs):
    """Run `python args...` from the repository root; return the CompletedProcess."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


BAR = "%|"  # in every line tqdm draws


def line_starting(output: str, start: str) -> int:
    """The index of the line of `output` (split at newlines only: a bar's redraws share its line) that starts with
    `start`; fails, showing the lines, when none does."""
    lines = output.split("\n")
    found = [i for i, line in enumerate(lines) if line.startswith(start)]
    assert found, f"no line starts with {start!r}:\n" + "\n".join(repr(line[-160:]) for line in lines[-12:])
    return found[0]


def assert_whole_line(output: str, start: str) -> None:
    """`start` begins a line of `output`; where a progress bar's line comes before it, that line ends with the
    bar's last state (the message did not overwrite or clear it)."""
    lines = output.split("\n")
    at = line_starting(output, start)
    bars = [line for line in lines[:at] if BAR in line]
    if bars:
        assert BAR in bars[-1].rsplit("\r", 1)[-1], bars[-1][-300:]


def resolved(config_class, **fields):
    """`config_class(**fields)` as the command line gives it with these flags typed, after the run-directory rule
    (a resume takes the flags not typed from the run's config.json)."""
    config = config_class(**fields)
    config.given = set(fields)
    resolve_run(config)
    return config
