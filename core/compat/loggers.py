"""Loggers for `Fabric(loggers=...)`: `fabric.log_dict(metrics, step)` calls `log_metrics` on each.

Both write on rank 0 only and follow Lightning's logger interface (`log_metrics`, `log_hyperparams`,
`save`, `finalize`, `log_dir`), so a Lightning logger can stand in for either, and these for Lightning's.

    fabric = Fabric(loggers=[CSVLogger("runs/exp"), TensorBoardLogger("runs/exp")])
    fabric.log_dict({"loss": loss}, step=step)
"""
import atexit
import csv
import os
from pathlib import Path

from core.checkpoint.files import atomic_write


def _is_rank_zero() -> bool:
    import torch.distributed as dist
    return (dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0


class CSVLogger:
    """`root_dir/metrics.csv`: one row per `log_metrics` call, a `step` column and one column per metric
    name seen so far. Rows are appended every `flush_every` calls and at the end; the file is rewritten only
    when a new metric name widens the header. `start_step`: the step a resumed run continues from; the rows
    of an earlier file up to it are kept, the later ones (logged after that checkpoint) dropped. Without it,
    an earlier file is continued as it is."""

    def __init__(self, root_dir, flush_every: int = 100, start_step: int | None = None):
        self.log_dir = Path(root_dir)
        self.path = self.log_dir / "metrics.csv"
        self.flush_every, self.start_step = flush_every, start_step
        self._rows, self._columns = [], ["step"]
        self._written, self._written_columns = 0, None  # rows in the file, and its header
        self._opened = False  # whether an existing file has been read
        atexit.register(self.save)  # rows logged since the last flush are written when the script ends

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if not _is_rank_zero():
            return
        self._rows.append({"step": step, **metrics})
        self._columns += [name for name in metrics if name not in self._columns]
        if len(self._rows) - self._written >= self.flush_every:
            self.save()

    def log_hyperparams(self, params: dict) -> None:
        if _is_rank_zero():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / "hparams.csv", "w", newline="") as f:
                csv.writer(f).writerows(sorted(params.items()))

    def save(self) -> None:
        if not _is_rank_zero() or (self._opened and self._written == len(self._rows)):
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self._opened:
            self._opened = True
            self._take_in_existing_rows()
        if self._written_columns == self._columns:  # the header holds: append the new rows
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._columns).writerows(self._rows[self._written:])
        else:
            def write(f):
                writer = csv.DictWriter(f, fieldnames=self._columns)
                writer.writeheader()
                writer.writerows(self._rows)
            atomic_write(self.path, write, mode="w")
            self._written_columns = list(self._columns)
        self._written = len(self._rows)

    def finalize(self, status: str = "success") -> None:
        self.save()

    def _take_in_existing_rows(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            rows, columns = list(reader), list(reader.fieldnames or [])
        if self.start_step is not None:
            rows = [row for row in rows if not row.get("step", "").isdigit() or int(row["step"]) <= self.start_step]
        self._rows = rows + self._rows
        self._columns = columns + [name for name in self._columns if name not in columns]
        self._written, self._written_columns = 0, None  # rewrite once with the kept rows


class TensorBoardLogger:
    """TensorBoard event files in `root_dir` (`tensorboard --logdir root_dir`); needs the `tensorboard`
    package: pip install -e '.[tensorboard]'."""

    def __init__(self, root_dir, **writer_options):
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ModuleNotFoundError("TensorBoardLogger needs the tensorboard package: pip install -e "
                                      "'.[tensorboard]' (or pip install tensorboard), or use CSVLogger.",
                                      name="tensorboard") from None
        self.log_dir = Path(root_dir)
        self._writer_options = writer_options
        self._writer = None

    @property
    def experiment(self):
        """The torch SummaryWriter, made on first use (on rank 0)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=str(self.log_dir), **self._writer_options)
        return self._writer

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if not _is_rank_zero():
            return
        for name, value in metrics.items():
            self.experiment.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: dict) -> None:
        if _is_rank_zero():
            self.experiment.add_text("hparams", "\n".join(f"{k}: {v}" for k, v in sorted(params.items())))

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
