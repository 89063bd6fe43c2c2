"""Loggers for core.compat's `Fabric(loggers=...)`: `fabric.log_dict(metrics, step)` calls `log_metrics` on each.

Both write on rank 0 only and follow Lightning's logger interface (`log_metrics`, `log_hyperparams`,
`save`, `finalize`, `log_dir`), so a Lightning logger can stand in for either, and these for Lightning's.

    fabric = Fabric(loggers=[CSVLogger("runs/exp"), TensorBoardLogger("runs/exp")])
    fabric.log_dict({"loss": loss}, step=step)
"""
import csv
import os
from pathlib import Path

from core.checkpoint.files import atomic_write


def _is_rank_zero() -> bool:
    import torch.distributed as dist
    return (dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0


class CSVLogger:
    """`root_dir/metrics.csv`: one row per `log_metrics` call, a `step` column and one column per metric
    name seen so far. Each row is appended as it is logged; the file is rewritten (atomically, from itself) only
    when a new metric name widens the header. `start_step`: the step a resumed run continues from; the rows
    of an earlier file up to it are kept, the later ones (logged after that checkpoint) dropped. Without it,
    an earlier file is continued as it is."""

    def __init__(self, root_dir, start_step: int | None = None):
        self.log_dir = Path(root_dir)
        self.path = self.log_dir / "metrics.csv"
        self.start_step = start_step
        self._columns = None  # the file's header, read when the first row is written

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if not _is_rank_zero():
            return
        row = {"step": step, **metrics}
        if self._columns is None:
            self._open()
        new = [name for name in row if name not in self._columns]
        if new or not self.path.exists():
            self._rewrite(self._read_rows(), self._columns + new)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self._columns).writerow(row)

    def log_hyperparams(self, params: dict) -> None:
        if _is_rank_zero():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / "hparams.csv", "w", newline="") as f:
                csv.writer(f).writerows(sorted(params.items()))

    def save(self) -> None:
        """Every row is in the file as soon as it is logged: nothing to write."""

    def finalize(self, status: str = "success") -> None:
        pass

    def _open(self) -> None:
        """Take over an earlier file: its header, and with `start_step` only its rows up to that step."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        rows = self._read_rows()
        self._columns = list(rows[0]) if rows else ["step"]
        if self.path.exists():
            with open(self.path, newline="") as f:
                self._columns = next(csv.reader(f), None) or ["step"]
        if self.start_step is not None and rows:
            kept = [row for row in rows if not row.get("step", "").isdigit() or int(row["step"]) <= self.start_step]
            if len(kept) < len(rows):
                self._rewrite(kept, self._columns)

    def _read_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def _rewrite(self, rows: list[dict], columns: list[str]) -> None:
        def write(f):
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        atomic_write(self.path, write, mode="w")
        self._columns = columns


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
