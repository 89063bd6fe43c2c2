"""The Lightning Fabric drop-in: a layer on top of core for scripts ported from Lightning Fabric.

    from core.compat import Fabric, CSVLogger     # was: from lightning.fabric import Fabric ...

| file | what |
| --- | --- |
| `fabric.py` | `Fabric`: core.Fabric with callbacks, loggers, `rank_zero_first`, `init_module`, `load_raw`, ... |
| `spawn.py` | ddp_spawn, ddp_fork, ddp_notebook: `fabric.launch(fn)` in new processes |
| `dp.py` | dp: torch.nn.DataParallel in one process |
| `environment.py` | `fabric run`'s environment variables |
| `loggers.py` | `CSVLogger`, `TensorBoardLogger` for `Fabric(loggers=...)` |

Nothing below this package imports it: the workloads run on core.Fabric without it.
"""
from core.compat.fabric import Fabric
from core.compat.loggers import CSVLogger, TensorBoardLogger

__all__ = ["CSVLogger", "Fabric", "TensorBoardLogger"]
