"""Lightning's `ddp_spawn` (and `ddp_fork`, `ddp_notebook`): DDP in N new processes that `fabric.launch(fn)` starts
through torch.multiprocessing, each running `fn(fabric, *args)`; rank 0's result is returned. The workloads
re-run their script for each rank instead (core/launcher/processes.py)."""
import os
import signal
import sys

import torch

from core.launcher import stores
from core.launcher.environment import cluster_environment, threads_per_process
from core.strategies.ddp import DDP


class DDPSpawn(DDP):
    """DDP in processes started by `fabric.launch(fn)` (`start_method` "fork" for ddp_fork and ddp_notebook, as
    Lightning names them: fork works from a notebook, where spawn cannot import the function)."""

    def __init__(self, device, precision, start_method: str = "spawn", **options):
        super().__init__(device, precision, **options)
        self.start_method = start_method


def spawn(fn, num_processes: int, fabric, args, kwargs):
    """strategy='ddp_spawn': run fn(fabric, *args) in N new processes and return rank 0's result."""
    import torch.multiprocessing as mp

    method = fabric.strategy.start_method
    port = stores.host_store(num_processes)  # held by this process, which is no rank: every rank is a client of it
    queue = mp.get_context(method).SimpleQueue()
    threads = threads_per_process(num_processes)
    context = mp.start_processes(_spawned, args=(fn, num_processes, port, threads, fabric, args, kwargs, queue),
                                 nprocs=num_processes, join=False, start_method=method)
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as error:
        raise RuntimeError(f"rank {error.error_index} failed:\n{error}") from None
    except mp.ProcessExitedException as error:
        raise RuntimeError(f"rank {error.error_index} exited with code {error.exit_code}"
                           f"{' (' + signal.Signals(-error.exit_code).name + ')' if error.exit_code < 0 else ''}; "
                           f"the other ranks were stopped.") from None
    finally:
        stores.release()
    return queue.get() if not queue.empty() else None


def _spawned(rank, fn, num_processes, port, threads, fabric, args, kwargs, queue):
    # The process ends with os._exit once its work is done: gloo's threads can abort the interpreter's
    # normal shutdown ("terminate called without an active exception"), which would fail a good run.
    stores.release()  # a forked rank's copy of the parent's server: this rank is a client (own_store)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(num_processes),
                      LOCAL_WORLD_SIZE=str(num_processes), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0",
                      CORE_STORE_CLIENT="1")
    torch.set_num_threads(threads)
    fabric._start_distributed(cluster_environment())
    result = fn(fabric, *args, **kwargs)
    if rank == 0:
        queue.put(result)
    fabric.wait_for_save()  # os._exit below would end a background write mid-way
    fabric.barrier()
    fabric.strategy.teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
