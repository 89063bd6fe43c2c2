"""Running a script's command line in the test's own process, as `python -m` would: runpy as __main__, sys.argv,
the working directory, the run directory's at-exit work at its end, warnings shown as Python shows them. For
commands that end before any process starts (bad flags, refusals): they pay no interpreter start."""
import contextlib
import io
import os
import runpy
import shlex
import signal
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from common import rundir


class TooLong(BaseException):
    """Raised by SIGALRM in a command that runs too long; a BaseException, so that no `except` stops it."""


def run_module(module: str, args: list[str], work: Path, seconds: int = 30, stdout=None) -> tuple[int, str]:
    """Run `python -m module *args` in `work`, in this process as `python -m` would: its exit status and its
    stderr (warnings included); its stdout goes to `stdout` (a text stream) where given."""
    at_exit, stderr, environment = [], io.StringIO(), dict(os.environ)

    def too_long(signum, frame):
        raise TooLong(f"python -m {module} {shlex.join(args)} ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as warned, \
            contextlib.redirect_stdout(stdout or io.StringIO()), contextlib.redirect_stderr(stderr):
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)  # as Python's own filters, without -W and -X dev
        # runpy's note that another test imported the module already: `python -m` starts without it
        warnings.filterwarnings("ignore", message=".* found in sys.modules after import of package")
        patch.chdir(work)
        patch.setattr(sys, "argv", [module, *args])
        patch.setattr(rundir, "atexit", SimpleNamespace(register=lambda *call: at_exit.append(call)))
        signal.alarm(seconds)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as stop:
            status = stop.code or 0
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            for function, *arguments in reversed(at_exit):  # this process's exit, which runs them last-in first
                function(*arguments)
            os.environ.clear()
            os.environ.update(environment)
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in warned)
    return status, stderr.getvalue() + shown
