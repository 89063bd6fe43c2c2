"""Launching: the processes of a run, how they meet, and how they end together.

Two ways in:
- the script was started by torchrun or SLURM: the environment names this process's rank; start nothing;
- strategy `ddp` (and fsdp, deepspeed): the script re-runs itself (`python -m pkg.mod ...` included)
  for ranks 1..N-1 and this process becomes rank 0.
(The drop-in's `ddp_spawn`, a function run in N fresh processes, is `core/compat/spawn.py`.)

| file | concern |
| --- | --- |
| `environment.py` | the ranks torchrun or SLURM gave this process; threads per process |
| `stores.py` | the rendezvous store the ranks meet through (rank 0's, or torchrun's agent store per restart) |
| `processes.py` | starting the other ranks (the script re-run) |
| `children.py` | rank 0 watches its ranks and they watch it: a dead rank ends the run within a second |
| `ending.py` | the end of a run: a bounded meeting at exit, teardown, stopping ranks after a failure |
"""
from core.launcher.ending import end_run_at_exit, mark_failed  # noqa: F401
from core.launcher.environment import cluster_environment, set_threads  # noqa: F401
from core.launcher.environment import threads_per_process  # noqa: F401
from core.launcher.processes import start  # noqa: F401
from core.launcher.stores import own_store  # noqa: F401
