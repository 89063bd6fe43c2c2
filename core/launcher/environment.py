"""Where this process stands: the ranks an outside launcher (torchrun, SLURM) gave it, and how many threads each
process of a run on this machine gets."""
import os
import sys

import torch

from core.errors import CoreValueError


def cluster_environment() -> dict | None:
    """Ranks given by an outside launcher (torchrun or SLURM), or None when the script runs alone."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:  # torchrun, or our own re-run
        world_size = int(env["WORLD_SIZE"])
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        return {"global_rank": int(env["RANK"]), "local_rank": int(env["LOCAL_RANK"]),
                "world_size": world_size, "node_rank": int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
                "local_world_size": local_world_size}
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") != "bash":
        nodes = env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        env.setdefault("MASTER_ADDR", _first_slurm_host(nodes))
        env.setdefault("MASTER_PORT", str(12910 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
        return {"global_rank": int(env["SLURM_PROCID"]), "local_rank": int(env["SLURM_LOCALID"]),
                "world_size": int(env["SLURM_NTASKS"]), "node_rank": int(env.get("SLURM_NODEID", 0)),
                "local_world_size": int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])}
    return None


def _first_slurm_host(nodelist: str) -> str:
    # "node[01-04],gpu7" -> "node01"; a plain name is returned as is
    first = nodelist.split(",")[0]
    if "[" in first:
        prefix, ranges = first.split("[", 1)
        first = prefix + ranges.split("-")[0].split(",")[0].rstrip("]")
    return first


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what taskset, SLURM or a container left this process
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(processes_on_this_machine: int, announce: bool = True) -> int:
    """Torch's intra-op threads for each of the processes of a run on this machine.

    Like torchrun, a run of several processes on one machine does not leave each of them torch's default
    of one thread per core: that oversubscribes the cores and, under any other load, made steps 4-10x
    slower. OMP_NUM_THREADS, when set (by the user, or by torchrun to 1), is used as it is; otherwise each
    process gets its share of the cores this process may use, and `announce` says so once."""
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise CoreValueError(f"OMP_NUM_THREADS={chosen!r} is not a whole number >= 1; set it to the threads each "
                                 f"process should use, or unset it to share the cores between the processes.")
        return int(chosen)
    cores = _usable_cores()
    threads = max(1, cores // processes_on_this_machine)
    if announce and processes_on_this_machine > 1:
        print(f"[core] {processes_on_this_machine} processes share {cores} cores: {threads} thread(s) each. "
              f"Set OMP_NUM_THREADS to choose another number.", file=sys.stderr, flush=True)
    return threads


def set_threads(processes_on_this_machine: int, announce: bool = True) -> None:
    """Apply threads_per_process to this process, and to the processes it starts (OMP_NUM_THREADS)."""
    threads = threads_per_process(processes_on_this_machine, announce)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
