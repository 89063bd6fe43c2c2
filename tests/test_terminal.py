"""What a user reads when a run ends badly: every message printed while the progress bar is open starts on a line
of its own, the bar's last state above it (common/terminal.py). The runs here read a script's real output, stdout
and stderr in one pipe as a terminal shows them; the multi-process exit paths are read the same way where their
tests run them (tests/test_lifecycle.py: an error on rank 1, a NaN on rank 1, a signal to one rank)."""
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.workloads import WORKLOADS
from common.terminal import WholeLines, _line_of, _lines
from tests.conftest import BAR, ROOT, assert_whole_line


@pytest.fixture(autouse=True)
def _forget_outputs():
    """What this process learnt about the files a test wrote to: another file may get the same inode later."""
    yield
    _lines.clear()


def test_a_message_after_a_bar_redraw_starts_a_line_and_the_close_adds_none(tmp_path):
    with open(tmp_path / "out", "w") as file:
        stream = WholeLines(file)
        stream.write("\rbar 1/4")
        stream.write("a warning")  # print writes its text, then the newline
        stream.write("\n")
        stream.write("\rbar 2/4")
        stream.write("\rbar 4/4")
        stream.write("\n")  # tqdm's close: the bar's line ends, no empty line
        stream.write("after\n")
        stream.write("no newline yet")  # held until its newline or a flush
        file.flush()  # the file's own buffer, not the stream's
        assert (tmp_path / "out").read_bytes().decode() == "\rbar 1/4\na warning\n\rbar 2/4\rbar 4/4\nafter\n"
        stream.flush()
    assert (tmp_path / "out").read_bytes().decode().endswith("after\nno newline yet")


def test_stdout_and_stderr_to_one_file_share_its_last_line(tmp_path):
    with open(tmp_path / "out", "w") as file, open(tmp_path / "out", "a") as same:
        bar, printed = WholeLines(file), WholeLines(same)
        bar.write("\rbar 1/4")
        bar.flush()
        printed.write("Stopped by SIGTERM\n")
        printed.flush()
    assert (tmp_path / "out").read_bytes().decode() == "\rbar 1/4\nStopped by SIGTERM\n"


CHILD = """
import sys
from common.terminal import keep_lines_whole
keep_lines_whole()
sys.stderr.write(sys.argv[1])
sys.stderr.flush()
"""


def test_under_several_processes_another_rank_starts_its_line_after_this_ranks_bar(tmp_path, monkeypatch):
    """Rank 0 draws the bar, rank 1 (another process writing to the same output) prints a message: it starts on a
    line of its own, and so does rank 0's next message after it and its redrawn bar."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(sys.modules["tempfile"], "tempdir", str(tmp_path))  # the shared byte's file, left here
    out = tmp_path / "out"
    with open(out, "w") as file:
        stream = WholeLines(file)
        stream.write("\rbar 1/4")
        stream.flush()
        for message in ("rank 1 says\n", "rank 1 again\n"):
            subprocess.run([sys.executable, "-c", CHILD, message], stderr=file, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), "LOCAL_RANK": "1"})
        stream.write("\rbar 2/4")
        stream.write("rank 0 says\n")
        stream.flush()
        shared = getattr(_line_of(file), "path", None)
    assert out.read_bytes().decode() == "\rbar 1/4\nrank 1 says\nrank 1 again\n\rbar 2/4\nrank 0 says\n"
    assert [path.name for path in tmp_path.glob("suite-line-*")] == [shared.name]


WARN_THEN_FULL = """
import errno
import warnings

from common.rundir import RunDir

log, calls = RunDir.log, [0]


def log_on_a_filling_disk(self, record):  # the first log warns, the second finds the disk full
    calls[0] += 1
    if calls[0] == 1:
        warnings.warn("the disk is nearly full")
    if calls[0] == 2:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "metrics.jsonl"))
    return log(self, record)


RunDir.log = log_on_a_filling_disk
"""


@pytest.mark.parametrize("script", [f"{name}.{variant}" for name in WORKLOADS for variant in ("train_torch", "train")])
def test_every_script_prints_a_warning_and_an_error_on_lines_of_their_own_below_its_bar(tmp_path, script):
    """The real script on its default data: a warning at the first log step (the run goes on), the disk full at
    the second (exit 2). In the one output a terminal shows, each message starts a line; the bar's last state
    stays on the line above the error, which is the last line."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(textwrap.dedent(WARN_THEN_FULL))
    result = subprocess.run([sys.executable, "-m", script, "--max-steps", "6", "--log-every", "2", "--out",
                             str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=240, env={**os.environ, "PYTHONPATH": f"{tmp_path / 'hook'}:{ROOT}",
                                                         "OMP_NUM_THREADS": "1"})
    output = result.stdout
    assert result.returncode == 2, output[-3000:]
    assert_whole_line(output, f"{tmp_path / 'hook' / 'sitecustomize.py'}:")  # the warning's own line
    error = f"python -m {script}: error: no space left on the disk writing {tmp_path / 'run' / 'metrics.jsonl'}"
    assert_whole_line(output, error)
    lines = output.rstrip("\n").split("\n")
    assert lines[-1].startswith(error) and BAR in lines[-2] and "4/6" in lines[-2].rsplit("\r", 1)[-1], lines[-2:]
