"""Launching: the processes of a run, how they meet, and how they end together.

Three ways in:
- the script was started by torchrun or SLURM: the environment names this process's rank; start nothing;
- strategy `ddp` (and fsdp, deepspeed): the script re-runs itself (`python -m pkg.mod ...` included)
  for ranks 1..N-1 and this process becomes rank 0;
- strategy `ddp_spawn`: `torch.multiprocessing` runs a function in N fresh processes.

| file | concern |
| --- | --- |
| `environment.py` | the ranks torchrun, SLURM or `fabric run` gave this process; threads per process |
| `stores.py` | the rendezvous store the ranks meet through (rank 0's, or torchrun's agent store per restart) |
| `processes.py` | starting the other ranks (re-run or spawn) |
| `children.py` | rank 0 watches its ranks and they watch it: a dead rank ends the run within a second |
| `ending.py` | the end of a run: a bounded meeting at exit, teardown, stopping ranks after a failure |
"""
from core.launcher.ending import end_run_at_exit, mark_failed  # noqa: F401
from core.launcher.environment import cluster_environment, from_cli, set_threads, started_by_cli  # noqa: F401
from core.launcher.environment import threads_per_process  # noqa: F401
from core.launcher.processes import spawn, start  # noqa: F401
from core.launcher.stores import free_port, own_store  # noqa: F401
