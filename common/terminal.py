"""Whole lines beside a progress bar: a message printed while tqdm's bar holds the last line of the output (the bar
redraws that line with '\\r' and no newline) starts on a line of its own, and the bar's last state stays above it.
A run that ends with an error closes its bars before the message (`close_bars`), so the message is the last line.

Every run installs it (`common.config.cli`): `sys.stdout` and `sys.stderr` become `WholeLines` streams, so errors,
stop reports, warnings, tracebacks and core's launcher messages all go through it. Streams that reach the same
output (a terminal, a log file, a pipe: the same device and inode) share what they know about its last line; under
several processes on one machine (LOCAL_WORLD_SIZE > 1) that is one byte in a file named for the output, so rank
1's message after rank 0's bar starts on a new line too. What the C++ side writes to file descriptor 2 directly
(gloo's or NCCL's logs) does not pass through it.
"""
import atexit
import os
import sys
import tempfile
import weakref
from pathlib import Path

from tqdm import tqdm


class _Line:
    """What one process knows about the last line of an output: whether a bar drew it and left it open."""

    def __init__(self):
        self.open = False

    def get(self) -> bool:
        return self.open

    def set(self, value: bool) -> None:
        self.open = value


class _SharedLine(_Line):
    """The same, in one byte of a file that every process writing to the output reads and writes."""

    def __init__(self, output: tuple[int, int]):
        super().__init__()
        self.path = Path(tempfile.gettempdir()) / f"suite-line-{output[0]}-{output[1]}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0 of the machine, which draws the bar, removes it at its
            atexit.register(self.path.unlink, missing_ok=True)  # end (the others keep theirs open; a killed run leaves it)

    def get(self) -> bool:
        return os.pread(self.fd, 1, 0) == b"1"

    def set(self, value: bool) -> None:  # (at most one per bar redraw: tqdm redraws ~10 times a second)
        os.pwrite(self.fd, b"1" if value else b"0", 0)


_lines: dict = {}  # output (device, inode) or id(stream) -> its _Line; one per output and kind


def _line_of(stream) -> _Line:
    try:
        stat = os.fstat(stream.fileno())
        output = (stat.st_dev, stat.st_ino)
    except (AttributeError, OSError, ValueError):  # a stream without a file (a test's capture)
        output = (0, id(stream))
    shared = output[0] != 0 and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
    key = (shared, output)
    if key not in _lines:
        try:
            _lines[key] = _SharedLine(output) if shared else _Line()
        except OSError:  # no writable temporary folder: this process's own view
            _lines[key] = _Line()
    return _lines[key]


class WholeLines:
    """A text stream that starts a line of its own for any write after a bar's open line. A bar's redraw (a write
    that starts with '\\r') opens the line; a piece of text without its newline is held until the newline comes (or
    a flush), so that one line leaves in one write and another process's bar cannot land inside it."""

    def __init__(self, stream):
        self.stream = stream
        self.held = ""

    def write(self, text: str) -> int:
        line = _line_of(self.stream)
        if text.startswith("\r"):  # a bar redraws the line
            self._release(line)
            self.stream.write(text)
            line.set(not text.endswith("\n"))
            return len(text)
        self.held += text
        if "\n" in text:
            self._release(line)
        return len(text)

    def _release(self, line: _Line) -> None:
        if not self.held:
            return
        text, self.held = self.held, ""
        if line.get() and not text.startswith("\n"):
            text = "\n" + text
        self.stream.write(text)
        line.set(False)

    def flush(self) -> None:
        if self.held:
            self._release(_line_of(self.stream))
        self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, buffer, ...: the stream's own
        return getattr(self.stream, name)


def keep_lines_whole() -> None:
    """Make this process's stdout and stderr `WholeLines` streams (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, WholeLines):
            setattr(sys, name, WholeLines(stream))


_bars = weakref.WeakSet()  # the bars progress_bar made, open or closed


def progress_bar(**options) -> tqdm:
    """A tqdm bar that `close_bars` closes."""
    bar = tqdm(**options)
    _bars.add(bar)
    return bar


def close_bars() -> None:
    """Close every open bar: its last state is drawn once more and its line ends, so what follows stands below it
    (rather than the bar redrawn under an error when the interpreter collects it at exit)."""
    for bar in list(_bars):
        bar.close()
