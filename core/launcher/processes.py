"""Starting the processes of a run: none under torchrun or SLURM; the script re-run for ranks 1..N-1 (ddp,
fsdp, deepspeed); or a function in N new processes through torch.multiprocessing (ddp_spawn)."""
import os
import signal
import subprocess
import sys

import torch

from core.launcher import children, stores
from core.launcher.environment import cluster_environment, set_threads, threads_per_process


def start(devices: int, num_nodes: int) -> dict:
    """This process's ranks for a run of `devices` processes on each of `num_nodes` machines: from torchrun or
    SLURM when they started it, else from re-running the script for ranks 1..devices-1 on this machine."""
    env = cluster_environment()
    if env is None:
        if num_nodes > 1:
            raise RuntimeError(f"num_nodes={num_nodes} needs an outside launcher: on each node run `torchrun "
                               f"--nnodes {num_nodes} --nproc-per-node {devices} --node-rank R --master-addr HOST "
                               f"script.py ...` (or srun under SLURM).")
        return rerun_for_other_ranks(devices) if devices > 1 else solo_environment()
    if env["world_size"] != devices * num_nodes:
        raise RuntimeError(f"The launcher started {env['world_size']} processes, but devices={devices} x "
                           f"num_nodes={num_nodes} = {devices * num_nodes}. Make them agree.")
    set_threads(env["local_world_size"], announce=env["local_rank"] == 0)
    children.watch_parent()
    return env


def solo_environment() -> dict:
    """A process group of one, for a distributed strategy asked to run on a single process."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(stores.host_store(1))
    return {"global_rank": 0, "local_rank": 0, "world_size": 1, "node_rank": 0, "local_world_size": 1}


def _this_command() -> list[str]:
    """The command line that started this process, as `python -m mod` when it was started that way."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name, *sys.argv[1:]]
    if not getattr(main, "__file__", None):
        raise RuntimeError("strategy='ddp' re-runs your script for the other ranks, but this process was not "
                           "started from a script (an interactive session or notebook). Use "
                           "strategy='ddp_spawn' with fabric.launch(fn), or start the script with torchrun.")
    return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]


def rerun_for_other_ranks(num_processes: int) -> dict:
    """Start ranks 1..N-1 as copies of this command; return the environment of rank 0 (this process)."""
    port = stores.host_store(num_processes)
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(num_processes),
            "LOCAL_WORLD_SIZE": str(num_processes), "NODE_RANK": "0", "GROUP_RANK": "0"}
    os.environ.update(base, RANK="0", LOCAL_RANK="0")
    set_threads(num_processes)  # also sets OMP_NUM_THREADS, which the other ranks inherit
    command = _this_command()
    ranks = {}
    for rank in range(1, num_processes):
        env = {**os.environ, **base, "RANK": str(rank), "LOCAL_RANK": str(rank), "CORE_PARENT_PID": str(os.getpid()),
               "CORE_STORE_CLIENT": "1"}
        ranks[rank] = subprocess.Popen(command, env=env)
    children.watch(ranks)
    return cluster_environment()


def spawn(fn, num_processes: int, fabric, args, kwargs):
    """strategy='ddp_spawn': run fn(fabric, *args) in N new processes and return rank 0's result."""
    import torch.multiprocessing as mp

    method = getattr(fabric.strategy, "start_method", "spawn")
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
    fabric.barrier()
    fabric._strategy.teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
