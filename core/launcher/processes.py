"""Starting the processes of a run: none under torchrun or SLURM; else the script re-run for ranks 1..N-1 (ddp,
fsdp, deepspeed). (ddp_spawn's function in N new processes is the Lightning drop-in's: core/compat/spawn.py.)"""
import os
import subprocess
import sys

from core.errors import CoreRuntimeError
from core.launcher import children, stores
from core.launcher.environment import cluster_environment, set_threads


def start(devices: int, num_nodes: int) -> dict:
    """This process's ranks for a run of `devices` processes on each of `num_nodes` machines: from torchrun or
    SLURM when they started it, else from re-running the script for ranks 1..devices-1 on this machine."""
    env = cluster_environment()
    if env is None:
        if num_nodes > 1:
            raise CoreRuntimeError(f"num_nodes={num_nodes} needs an outside launcher: on each node run `torchrun "
                                   f"--nnodes {num_nodes} --nproc-per-node {devices} --node-rank R --master-addr HOST "
                                   f"script.py ...` (or srun under SLURM).")
        return rerun_for_other_ranks(devices) if devices > 1 else solo_environment()
    if env["world_size"] != devices * num_nodes:
        raise CoreRuntimeError(f"The launcher started {env['world_size']} processes, but devices={devices} x "
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
        raise CoreRuntimeError("strategy='ddp' re-runs your script for the other ranks, but this process was not "
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
