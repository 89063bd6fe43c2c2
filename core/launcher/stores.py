"""The rendezvous stores the ranks of a run meet through: rank 0's bound before any other rank starts, or a
client of torchrun's agent store, one key prefix per restart."""
import os


_store = None  # rank 0's TCPStore in a process that starts the other ranks itself (host_store)


def host_store(world_size: int) -> int:
    """Start rank 0's rendezvous store on a port the OS picks, bound before any other rank starts (no window
    in which another process could take it), and return the port for the other ranks' MASTER_PORT."""
    global _store
    from torch.distributed import TCPStore
    _store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    return _store.port


def own_store():
    """The store init_process_group is given, or None for its own env:// rendezvous (SLURM):
    - a run whose ranks this launcher started: in rank 0 the store host_store started, elsewhere a client of it;
    - under torchrun: a client of the agent's store, its keys prefixed by the restart count. The agent keeps
      one store across the restarts of `--max-restarts`; with env://'s fixed key names a restarted rank could
      read a dead rank's address from the round before and fail in gloo's connection set-up. (Every agent
      counts a restart after a failure; an elastic membership change, `--nnodes MIN:MAX`, restarts without
      counting, so such jobs are not covered.)"""
    env = os.environ
    if _store is not None:
        return _store
    if "CORE_STORE_CLIENT" in env:
        return _client_store()
    if "TORCHELASTIC_RESTART_COUNT" in env and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from torch.distributed import PrefixStore
        return PrefixStore(f"core/restart{env['TORCHELASTIC_RESTART_COUNT']}/", _client_store())
    return None


def _client_store():
    """A client of the run's store, waiting as long as init_process_group's start-up does (30 minutes)."""
    import datetime

    from torch.distributed import TCPStore
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                    is_master=False, timeout=datetime.timedelta(minutes=30))


def release() -> None:
    """Drop this process's reference to the store host_store started (a spawned rank's forked copy, or the
    spawning process once its ranks are done)."""
    global _store
    _store = None
