"""The wrapper's host overhead per training step on a tiny, host-bound model (2-layer MLP, batch 8, SGD).

All variants drive the same model and optimizer objects (a wrapper on one CPU neither copies nor moves
them), so memory layout cannot favour one; only the code between the loop and torch differs. They run in
one process in blocks, in a new random order each round after a warm-up, so drift in the machine's
speed hits all; each block's time per step is one sample, and ratios are taken round by round.
Lightning Fabric is measured the same way when `lightning` is installed. Also: how long `import core`
takes against `import torch`.
"""
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.record import ROOT, spread


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def _loop(model, optimizer, backward, x, y, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        backward(F.cross_entropy(model(x), y))
        optimizer.step()
    return (time.perf_counter() - start) / steps


def measure(blocks: int = 30, steps: int = 200) -> dict:
    torch.set_num_threads(1)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    variants = {"plain": (model, optimizer, lambda loss: loss.backward())}

    from core import Fabric
    fabric = Fabric(accelerator="cpu")
    variants["core"] = (*fabric.setup(model, optimizer), fabric.backward)
    try:
        from lightning.fabric import Fabric as LightningFabric
        lightning = LightningFabric(accelerator="cpu", devices=1)
        variants["lightning"] = (*lightning.setup(model, optimizer), lightning.backward)
    except ImportError:
        pass

    samples = {name: [] for name in variants}
    for name, (model, optimizer, backward) in variants.items():  # warm-up
        _loop(model, optimizer, backward, x, y, steps)
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for _ in range(blocks):
        shuffle(order)
        for name in order:
            samples[name].append(_loop(*variants[name], x, y, steps) * 1e6)
    plain = statistics.median(samples["plain"])
    rows = []
    for name, values in samples.items():
        ratios = [v / p for v, p in zip(values, samples["plain"])]  # block by block: same moment, same machine
        rows.append({"variant": name, "us_per_step": spread(values), "ratio": spread(ratios),
                     "overhead_us": statistics.median(values) - plain})
    return {"rows": rows, "import": import_times(), "stop_check": stop_check_cost()}


def stop_check_cost(steps: int = 2000) -> dict:
    """What the loops' stop decision (common.run.StopRequests.check) costs per step: on one process (no
    reduction), and on 2 gloo processes of 1 thread (an all-reduce of 3 numbers through fabric.all_reduce
    every 10 steps, as the loops do)."""
    import torch.multiprocessing as mp

    from common.run import StopRequests

    stop, loss = StopRequests(), torch.tensor(1.0)
    one = _time_checks(stop, loss, steps)
    queue = mp.get_context("spawn").SimpleQueue()
    from core.launcher import free_port
    mp.start_processes(_stop_check_rank, args=(steps, free_port(), queue), nprocs=2, start_method="spawn")
    return {"one_process_us": one, "two_processes_us": queue.get()}


def _time_checks(stop, loss, steps: int) -> dict:
    samples = []
    for block in range(11):
        start = time.perf_counter()
        for step in range(steps // 10):
            stop.check(step, loss if step % 50 == 0 else None, ROOT / "no.ckpt")
        if block:  # the first block warms up
            samples.append((time.perf_counter() - start) / (steps // 10) * 1e6)
    return spread(samples)


def _stop_check_rank(rank: int, steps: int, port: int, queue) -> None:
    import os

    from common.run import StopRequests
    from core import Fabric
    from core.launcher import cluster_environment

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric._start_distributed(cluster_environment())
    result = _time_checks(StopRequests(fabric.device, fabric.all_reduce), torch.tensor(1.0), steps)
    if rank == 0:
        queue.put(result)
    fabric.barrier()
    fabric.strategy.teardown()
    os._exit(0)


def import_times(repeats: int = 7) -> dict:
    def seconds(code):
        values = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
            values.append(time.perf_counter() - start)
        return spread(values)

    torch_time, core_time = seconds("import torch"), seconds("import core")
    return {"torch_s": torch_time, "core_s": core_time, "ratio": core_time["median"] / torch_time["median"]}
