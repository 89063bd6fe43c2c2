"""Two ranks in one gloo process group, started once per test session and strategy family, that run the
distributed cases the tests send them: a case is a module-level function `case(fabric, *args)` run on both ranks
with a Fabric made in the running group (as under torchrun), and each rank's return value comes back.

Starting a 2-rank group (spawn, imports, rendezvous) costs 5-8 CPU seconds before any work; a case that only calls
the API pays it once per session here instead of once per test. Tests whose subject is the processes themselves
(signals, kills, restarts, several nodes, launching) start their own.

    def _sums(fabric):                                  # in a test module: importable by the ranks
        return fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum").item()

    def test_sum(two_ranks):
        assert two_ranks("ddp").run(_sums) == [3.0, 3.0]
"""
import multiprocessing
import os
import pickle
import socket
import sys
import traceback

from tests.conftest import HANG

FAMILIES = ("ddp", "fsdp", "deepspeed")  # one group each: DeepSpeed's global state stays out of the others'
GRACE = 30  # seconds the other rank has to answer once one has failed, before the group is replaced


class CaseError(AssertionError):
    """A case failed on a rank: its traceback as the rank printed it."""


class Group:
    def __init__(self, family: str):
        self.family, self.ranks = family, []

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        for rank in range(2):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(rank, port, child), daemon=True,
                                      name=f"{self.family}-rank-{rank}")
            process.start()
            child.close()
            self.ranks.append((process, parent))

    def run(self, case, *args, strategy: str | None = None, impl: str = "core", timeout: float = HANG,
            **fabric_options) -> list:
        """`case(fabric, *args)` on both ranks; their results in rank order. `strategy` defaults to the family's;
        `impl` "compat" makes the drop-in's Fabric; `fabric_options` go to Fabric(...)."""
        if not self.ranks:
            self.start()
        message = (case.__module__, case.__qualname__, args, strategy or self.family, impl, fabric_options)
        for _, connection in self.ranks:
            connection.send_bytes(pickle.dumps(message))
        answers, failed = [None, None], None
        for rank, (process, connection) in enumerate(self.ranks):
            wait = GRACE if failed is not None else timeout
            if not connection.poll(wait):
                self.close()
                raise CaseError(f"{case.__qualname__}: rank {rank} gave no answer in {wait:g} s (the group is "
                                f"restarted for the next case)" + (f"; rank {failed[0]} failed:\n{failed[1]}"
                                                                   if failed else ""))
            try:
                status, answers[rank] = pickle.loads(connection.recv_bytes())
            except (EOFError, OSError):  # the rank is gone
                process.join(timeout=10)
                self.close()
                raise CaseError(f"{case.__qualname__}: rank {rank} ended (exit code {process.exitcode}) without an "
                                f"answer (the group is restarted for the next case)") from None
            if status == "error" and failed is None:
                failed = (rank, answers[rank])
        if failed is not None:  # the ranks may have left the group's collectives out of step: a new group next
            self.close()
            raise CaseError(f"{case.__qualname__} failed on rank {failed[0]}:\n{failed[1]}")
        return answers

    def close(self) -> None:
        for process, connection in self.ranks:
            try:
                connection.send_bytes(pickle.dumps(None))
            except OSError:
                pass
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        self.ranks = []


def _serve(rank: int, port: int, connection) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # what torchrun sets: a Fabric made here finds its ranks and joins the running group
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    environment = dict(os.environ)
    while True:
        message = pickle.loads(connection.recv_bytes())
        if message is None:
            break
        module, name, args, strategy, impl, options = message
        try:
            case = importlib.import_module(module)
            for part in name.split("."):
                case = getattr(case, part)
            fabric_class = importlib.import_module("core.compat" if impl == "compat" else "core").Fabric
            fabric = fabric_class(accelerator="cpu", strategy=strategy, devices=2, **options)
            fabric.launch()
            answer = ("ok", case(fabric, *args))
            answer = pickle.dumps(answer)  # plain pickle, not multiprocessing's: tensors travel as bytes
        except BaseException:  # noqa: B036 - the rank reports whatever ended the case, and serves the next
            answer = pickle.dumps(("error", traceback.format_exc()))
        finally:
            os.environ.clear()  # a case's seed_everything leaves PL_GLOBAL_SEED for the next otherwise
            os.environ.update(environment)
        connection.send_bytes(answer)
    dist.destroy_process_group()
    sys.exit(0)
