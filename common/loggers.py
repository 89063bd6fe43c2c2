"""--logger, for both variants: the records a run writes to metrics.jsonl, also as `metrics.csv` (the csv
module) or as TensorBoard event files in `tensorboard/` (torch's SummaryWriter). A resumed run continues them
from its step: the CSV is rewritten from the records kept, TensorBoard purges the events after that step.
(core.compat holds Lightning-style loggers for its `Fabric(loggers=...)`; the training scripts use these.)"""
import csv
from pathlib import Path

from common.files import atomic_write

LOGGERS = ("csv", "tensorboard", "none")


class CSVRecords:
    """`metrics.csv`: a `step` column and one column per metric seen so far, one row per record. Rows are
    appended; the file is rewritten only when a new metric widens the header."""

    def __init__(self, path: Path, kept: list[dict]):
        self.path, self.rows, self.columns = path, [], ["step"]
        for record in kept:
            self._add(record)
        self._rewrite()

    def _add(self, record: dict) -> bool:
        """Keep `record`; True when it brings a new column."""
        new = [name for name in record if name not in self.columns]
        self.columns += new
        self.rows.append(record)
        return bool(new)

    def _rewrite(self) -> None:
        def write(f):
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        atomic_write(self.path, write, mode="w")

    def log(self, record: dict) -> None:
        if self._add(record):
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(record)

    def close(self) -> None:
        pass


class TensorBoardRecords:
    """Event files in `log_dir` (`tensorboard --logdir RUN/tensorboard`), a scalar per number of each record."""

    def __init__(self, log_dir: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)

    def log(self, record: dict) -> None:
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def make_loggers(kind: str, run_dir: Path, kept: list[dict], step: int) -> list:
    """The loggers --logger names, for a run in `run_dir` going on from `step` with the records `kept`."""
    if kind == "csv":
        return [CSVRecords(run_dir / "metrics.csv", kept)]
    if kind == "tensorboard":
        return [TensorBoardRecords(run_dir / "tensorboard", step)]
    return []


def check_logger(kind: str) -> None:
    if kind == "tensorboard":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("--logger tensorboard needs the tensorboard package: pip install -e '.[tensorboard]', "
                             "or use --logger csv") from None
