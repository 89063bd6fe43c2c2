"""What a new user meets first: threads per process, one-line errors, --help, and what a failed start
leaves behind."""
import configparser
import math
import os
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest
import torch

import gan.train
import metalearn.train
from benchmarks.workloads import WORKLOADS
from common.config import merge, parse
from common.data import DownloadFailed
from common.images import load_images
from common.resume import resolve_run
from common.rundir import RunDir
from core import Fabric, launcher
from core.cli import FabricFlags
from gan import train_torch
from gan.config import Config
from metalearn.config import Config as MetaConfig
from metalearn.data import make_tasks
from tests.conftest import HANG, ROOT, run
from tests.test_readme_blocks import PAGES

THREADS_PROBE = textwrap.dedent("""
    import os
    import torch
    from core import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    os.write(1, f"rank {fabric.global_rank} threads {torch.get_num_threads()}\\n".encode())  # one write
""")


def test_threads_per_process_share_the_cores_unless_omp_num_threads_says(monkeypatch, capsys):
    monkeypatch.setattr(launcher.environment, "_usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launcher.threads_per_process(2) == 4 and launcher.threads_per_process(16) == 1
    assert capsys.readouterr().err.count("Set OMP_NUM_THREADS") == 2
    assert launcher.threads_per_process(2, announce=False) == 4 and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice (or torchrun's) wins, silently
    assert launcher.threads_per_process(2) == 3 and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many' is not a whole number"):
        launcher.threads_per_process(2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("chosen", [None, "2"])
def test_every_rank_of_a_rerun_uses_the_same_threads(tmp_path, chosen):
    script = tmp_path / "probe.py"
    script.write_text(THREADS_PROBE)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    if chosen:
        env["OMP_NUM_THREADS"] = chosen
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    expected = int(chosen) if chosen else max(1, len(os.sched_getaffinity(0)) // 2)
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank 0 threads {expected}", f"rank 1 threads {expected}"]
    assert result.stderr.count("Set OMP_NUM_THREADS") == (0 if chosen else 1)  # said once, by rank 0


def one_line_error(result, *words):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(word in lines[0] for word in words), result.stderr


def help_text(capsys, config_class, module) -> str:
    with pytest.raises(SystemExit) as exit:
        parse(config_class, ["--help"], prog=f"python -m {module.__name__}", description=module.__doc__)
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_help_keeps_the_example_commands_apart_and_offers_only_what_runs(capsys):
    text = help_text(capsys, merge(Config, FabricFlags), gan.train)
    assert "\n    python -m gan.train --strategy ddp --devices 2 " in text  # one example per line, as written
    assert "(default: )" not in text and "(default: False)" in text and "(default: 3000)" in text
    assert "ddp_spawn" not in text  # it runs a function (fabric.launch(fn)), which the scripts do not
    assert "or auto: one per visible GPU" in " ".join(text.split())


def test_accelerator_cuda_without_a_gpu_is_one_line():
    result = run(["-m", "gan.train", "--accelerator", "cuda"], check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    one_line_error(result, "--accelerator cuda", "sees no CUDA device", "--accelerator cpu")


def test_a_deepspeed_strategy_without_deepspeed_names_the_extra(tmp_path, monkeypatch):
    shim = tmp_path / "shim" / "deepspeed"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'deepspeed' (simulated)\")\n")
    result = run(["-m", "gan.train", "--strategy", "deepspeed_stage_3", "--accelerator", "cpu", "--devices", "2"],
                 check=False,
                 env={"PYTHONPATH": f"{shim.parent}{os.pathsep}{ROOT}"})
    one_line_error(result, "deepspeed_stage_3", "pip install -e '.[deepspeed]'")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # the Python API: one error, before any process starts
    with pytest.raises(ModuleNotFoundError, match=r"needs DeepSpeed.*\[deepspeed\]"):
        Fabric(accelerator="cpu", strategy="deepspeed", devices=2)


def _no_network(*args, **kwargs):
    raise urllib.error.URLError("simulated: no network")


@pytest.mark.parametrize("name", ["mnist", "cifar10", "omniglot"])
def test_download_without_a_network_says_what_to_do_in_one_line(tmp_path, monkeypatch, name):
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    with pytest.raises(DownloadFailed) as error:
        if name == "omniglot":
            make_tasks("omniglot", 5, True, str(tmp_path), download=True)
        else:
            load_images(name, str(tmp_path), download=True)
    message = str(error.value)
    assert isinstance(error.value, ValueError) and "\n" not in message
    assert "simulated: no network" in message and "run without --download" in message
    assert "docs/datasets.md" in message and f"| `{name}` |" in (ROOT / "docs" / "datasets.md").read_text()


def test_download_without_a_network_from_the_command_line(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(textwrap.dedent("""
        import urllib.error, urllib.request

        def _no_network(*args, **kwargs):
            raise urllib.error.URLError("simulated: no network")

        urllib.request.urlopen = _no_network
    """))
    result = run(["-m", "gan.train", "--dataset", "cifar10", "--download", "--data-root", str(tmp_path / "data"),
                  "--out", str(tmp_path / "run")], check=False, env={"PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"})
    one_line_error(result, "could not download 'cifar10'", "simulated: no network", "cifar-10-batches-py")
    assert not (tmp_path / "run").exists()


def test_a_failed_start_leaves_no_run_directory(tmp_path):
    wrapped = merge(Config, FabricFlags)
    with pytest.raises(FileNotFoundError):  # a dataset that is not there
        gan.train.main(wrapped(dataset="mnist", data_root=str(tmp_path / "data"), out=str(tmp_path / "a")))
    with pytest.raises(ValueError, match="no checkpoint"):  # resuming a run that never was
        resolve_run(wrapped(dataset="fake", batch_size=8, resume=str(tmp_path / "b")))
    with pytest.raises(ValueError, match="no checkpoint"):
        resolve_run(Config(dataset="fake", batch_size=8, resume=str(tmp_path / "c" / "d")))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"is a file\); pass a writable --out"):
        RunDir(str(tmp_path / "file" / "run"), "gan")
    run_dir = RunDir(str(tmp_path / "new" / "run"), "gan")
    assert not run_dir.path.exists()
    run_dir.write_json("config.json", {})
    assert (run_dir.path / "checkpoints").is_dir()


def test_short_runs_and_fake_data_report_in_plain_words(tmp_path, capsys):
    train_torch.main(Config(dataset="fake", batch_size=8, ngf=8, ndf=8, nz=16, eval_samples=8, max_steps=2,
                            out=str(tmp_path / "gan")))
    printed = capsys.readouterr().out
    assert "not scored: fake data has no classes" in printed and "nan" not in printed
    metalearn.train.main(merge(MetaConfig, FabricFlags)(hidden=8, eval_tasks=4, max_steps=2, log_every=500,
                                                        accelerator="cpu", out=str(tmp_path / "maml")))
    printed = capsys.readouterr().out
    assert "after 0 steps " in printed and "1 step " in printed and "1 steps" not in printed


def test_class_entropy_of_one_class_is_plus_zero():
    from gan.score import class_entropy

    class OneClass:
        def logits(self, images):
            return torch.zeros(len(images), 10).index_fill_(1, torch.tensor([3]), 1.0)

    value = class_entropy(OneClass(), torch.zeros(5, 1, 8, 8))
    assert value == 0.0 and math.copysign(1.0, value) == 1.0  # printed as 0.000, not -0.000


WARNING = re.compile(r"warning|\bW\d{4} ", re.IGNORECASE)
# only for the plain GAN under torchrun: torchrun's note that it set OMP_NUM_THREADS=1, and torch's deprecation of
# the broadcast_buffers argument the plain script keeps (gan/README.md, Warnings, says why)
EXPLAINED = re.compile(r"Setting OMP_NUM_THREADS|\bW\d{4} .*torch/distributed/run\.py"
                       r"|`broadcast_buffers` is deprecated")


def readme_commands() -> list[str]:
    """The training commands of the bash blocks of the READMEs and docs/, except those that need dataset files."""
    commands = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.splitlines():
                command = line.split("#")[0].split("&&")[-1].strip()
                if re.match(r"(python -m (gan|autoencoder|metalearn)\.train|torchrun)", command) \
                        and "--data-root" not in command and command not in commands:
                    commands.append(command)
    return commands


def test_the_install_page_matches_setup_cfg():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    install = (ROOT / "docs" / "install.md").read_text()
    assert "docs/install.md" in (ROOT / "README.md").read_text()  # the README links it
    version = setup["options"]["python_requires"].removeprefix(">=")
    assert f"Python {version} or newer" in install
    extras = {name: sorted(re.split(r"[<>=!~ ]", spec.strip())[0] for spec in value.strip().splitlines())
              for name, value in setup["options.extras_require"].items()}
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*?) \|", install, re.M))
    assert {name: sorted(re.findall(r"`([\w-]+)`", adds)) for name, adds in rows.items()} == extras
    assert set(re.findall(r'pip install -e "\.\[(\w+)\]"', install)) == set(extras)
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in install


def test_an_installed_suite_holds_every_package():
    """`pip install .` (not editable) copies the packages setup.cfg names: a subpackage missing there imports in a
    checkout and fails in an install (`No module named 'core.strategies'`)."""
    from setuptools.config.setupcfg import read_configuration
    installed = set(read_configuration(ROOT / "setup.cfg")["options"]["packages"])
    top = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"]
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for d in top for init in d.rglob("__init__.py")}
    assert on_disk and on_disk <= installed, sorted(on_disk - installed)


def test_the_readme_commands_include_every_workload_and_torchrun():
    commands = readme_commands()
    assert len(commands) >= 10 and any(c.startswith("torchrun") for c in commands)
    assert {w for w in WORKLOADS if any(f"{w}.train" in c for c in commands)} == set(WORKLOADS)


DOWNLOADER = """
import sys, time
from pathlib import Path
from common.data import download_once

root, name = Path(sys.argv[1]), sys.argv[2]
with download_once(root, download=True):
    (root / f"{name}.start").write_text(str(time.monotonic()))
    time.sleep(1.0)  # a download in progress
    (root / f"{name}.end").write_text(str(time.monotonic()))
"""


def test_processes_downloading_into_one_root_take_turns(tmp_path):
    script = tmp_path / "downloader.py"
    script.write_text(DOWNLOADER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "data"), name], env=env)
                 for name in ("a", "b")]
    assert [p.wait(timeout=HANG) for p in processes] == [0, 0]
    spans = sorted((float((tmp_path / "data" / f"{n}.start").read_text()),
                    float((tmp_path / "data" / f"{n}.end").read_text())) for n in ("a", "b"))
    assert spans[0][1] <= spans[1][0]  # the second started after the first had finished


def test_a_download_runs_inside_the_lock(tmp_path, monkeypatch):
    import fcntl

    from torchvision import datasets

    held = []

    def mnist(root, **kwargs):
        held.append(kwargs["download"])
        lock = open(root / ".download.lock", "w")  # free only if nobody holds it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append("free")
        except BlockingIOError:
            held.append("held")
        raise RuntimeError("stop here")

    monkeypatch.setattr(datasets, "MNIST", mnist)
    with pytest.raises((ValueError, FileNotFoundError), match="stop here"):
        load_images("mnist", str(tmp_path), download=True)
    assert held == [True, "held"]


def test_a_value_error_from_inside_torch_is_a_crash_not_a_usage_error(tmp_path, monkeypatch, capsys):
    """The one-line exit 2 is for the suite's own checks; a ValueError torch raises in a step is a bug and
    keeps its traceback, whatever its class."""
    import torch.nn.functional as F

    from common.config import RunConfig, cli

    def step_with_a_bug(config):
        return F.binary_cross_entropy(torch.zeros(2), torch.zeros(3))  # torch: "Using a target size ..."

    def bad_input(config):
        from common.resume import resume_path
        resume_path(str(tmp_path / "missing"))  # the suite's own check

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(ValueError, match="target size"):
        cli(step_with_a_bug, RunConfig, prog="python -m x.train")
    with pytest.raises(SystemExit) as exited:
        cli(bad_input, RunConfig, prog="python -m x.train")
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"python -m x.train: error: --resume {tmp_path / 'missing'}: no checkpoint at " \
                                      f"{tmp_path / 'missing'}\n"


def test_a_full_disk_while_writing_a_log_or_a_sample_is_one_line(tmp_path, monkeypatch, capsys):
    """metrics.jsonl, the loggers' files and the samples are written by the run (common/), not by core's save: an
    OSError for lack of space there exits 2 with one line naming where; any other OSError keeps its traceback."""
    import errno

    from common.config import RunConfig, cli

    def log_on_a_full_disk(config):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))

    def another_os_error(config):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit) as exited:
        cli(log_on_a_full_disk, RunConfig, prog="python -m x.train")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"python -m x.train: error: no space left on the disk writing {tmp_path / 'metrics.jsonl'} (")
    with pytest.raises(OSError, match="Input/output error"):
        cli(another_os_error, RunConfig, prog="python -m x.train")
