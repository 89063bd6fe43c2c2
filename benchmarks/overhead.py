"""The wrapper's host overhead per training step on a tiny, host-bound model (2-layer MLP, batch 8, SGD),
on every path where core does work, each against the plain PyTorch that does the same:

- 32-true on one device (core hands back the original module's forward, optimizer step and backward);
- bf16-mixed (core: autocast inside the wrapper's forward, the output cast back to float32; plain: the
  same autocast written around the forward, the same cast);
- 16-mixed (core: one GradScaler per optimizer, found from the loss's graph by fabric.backward, stepped
  by the wrapped optimizer; plain: a GradScaler written out);
- ddp on 2 gloo processes (core: the DDP wrapper called through the set-up module and its submodule
  guard; plain: DistributedDataParallel called directly).

The variants of a path drive the same model and optimizer objects where they can (one device), so memory
layout cannot favour one; only the code between the loop and torch differs. They run in blocks, in a new
random order each round after a warm-up (the same order on both ranks under ddp), so drift in the
machine's speed hits all; each block's time per step is one sample, and ratios are taken block by block.
Lightning Fabric is measured the same way on the 32-true path when `lightning` is installed. Also: how
long `import core` takes against `import torch`, and what the loops' stop decision costs.
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


def _step(model, optimizer, backward, x, y) -> None:
    optimizer.zero_grad()
    backward(F.cross_entropy(model(x), y))
    optimizer.step()


def _timed(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _blocks(variants: dict, blocks: int, steps: int, path: str) -> list[dict]:
    """Rows of one path: every variant (a function doing one training step) timed in blocks, in a random
    order each round (seeded: every rank runs the same order), ratios to "plain" block by block."""
    for step in variants.values():  # warm-up
        _timed(step, steps)
    samples = {name: [] for name in variants}
    order, shuffle = list(variants), random.Random(0).shuffle
    for _ in range(blocks):
        shuffle(order)
        for name in order:
            samples[name].append(_timed(variants[name], steps) * 1e6)
    plain = statistics.median(samples["plain"])
    return [{"path": path, "variant": name, "us_per_step": spread(values),
             "ratio": spread([v / p for v, p in zip(values, samples["plain"])]),
             "overhead_us": statistics.median(values) - plain} for name, values in samples.items()]


def _mixed_variants(precision: str, x, y) -> dict:
    """Plain autocast (and GradScaler for 16-mixed) written out, against core's precision of that name."""
    from core import Fabric

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def plain():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)  # as core's output conversion
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    fabric = Fabric(accelerator="cpu", precision=precision)
    wrapped = _model()
    wrapped, wrapped_optimizer = fabric.setup(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.01))
    return {"plain": plain, "core": lambda: _step(wrapped, wrapped_optimizer, fabric.backward, x, y)}


def measure(blocks: int = 30, steps: int = 200, import_repeats: int = 7) -> dict:
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
    rows = _blocks({name: (lambda v=v: _step(*v, x, y)) for name, v in variants.items()}, blocks, steps, "32-true")
    for precision in ("bf16-mixed", "16-mixed"):
        rows += _blocks(_mixed_variants(precision, x, y), blocks, steps, precision)
    rows += ddp_rows(blocks, steps)
    return {"rows": rows, "import": import_times(import_repeats), "stop_check": stop_check_cost()}


def ddp_rows(blocks: int, steps: int) -> list[dict]:
    """The ddp path, measured on 2 spawned gloo processes of 1 thread; rank 0's rows."""
    import torch.multiprocessing as mp

    from core.launcher import free_port
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_ddp_rank, args=(blocks, steps, free_port(), queue), nprocs=2, start_method="spawn")
    return queue.get()


def _ddp_rank(rank: int, blocks: int, steps: int, port: int, queue) -> None:
    import os

    from torch.nn.parallel import DistributedDataParallel

    from core import Fabric
    from core.launcher import cluster_environment

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric._start_distributed(cluster_environment())
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    plain_model = DistributedDataParallel(_model())
    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    model = _model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    variants = {"plain": lambda: _step(plain_model, plain_optimizer, lambda loss: loss.backward(), x, y),
                "core": lambda: _step(model, optimizer, fabric.backward, x, y)}
    rows = _blocks(variants, blocks, steps, "ddp x2")
    if rank == 0:
        queue.put(rows)
    fabric.barrier()
    fabric.strategy.teardown()
    os._exit(0)


def stop_check_cost(steps: int = 2000) -> dict:
    """What the loops' stop decision (common.stopping.StopRequests.check) costs per step: on one process (no
    reduction), and on 2 gloo processes of 1 thread (an all-reduce of 3 numbers through fabric.all_reduce
    every 10 steps, as the loops do)."""
    import torch.multiprocessing as mp

    from common.stopping import StopRequests

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

    from common.stopping import StopRequests
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
    """Each import in a fresh interpreter, the two alternating, so a change of the host's load or file cache
    during the measurement falls on both alike."""
    seconds = {"import torch": [], "import core": []}
    for _ in range(repeats):
        for code, values in seconds.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
            values.append(time.perf_counter() - start)
    torch_time, core_time = spread(seconds["import torch"]), spread(seconds["import core"])
    return {"torch_s": torch_time, "core_s": core_time, "ratio": core_time["median"] / torch_time["median"]}
