"""MAML meta-iterations per second on sinusoid tasks (40-40 ReLU MLP, 1 inner step, alpha 0.01, 25 tasks):
the learner `python -m metalearn.train` runs (metalearn/maml.py: every task through its own expanded copy of the
weights, one batched matmul per layer; eager, and compiled by torch.compile as `--compile` does, its compilation
in the warm-up repeat), the same meta-loss by torch.func (`grad` of one task under `vmap`, the learner's
formulation before it was batched by hand), a per-task `autograd.grad(create_graph=True)` loop (the reference:
what plain PyTorch does without batching) and, when installed, a per-task loop written with `higher`. Setups: the
paper's (K=10 support, 10 query points per task) and the default `python -m metalearn.train` (metalearn/config.py's
values), measured once where they are the same. Before timing, in float64, the loop's meta-gradient is checked
against central finite differences, and each other method's against the loop's (allclose 1e-6).
Timing: float32, one thread; each repeat runs the methods in an order drawn at random (seeded, recorded). Against
the machine: the learner's matmul FLOPs per meta-iteration (torch's FlopCounterMode) times its it/s, as a
fraction of the FLOP/s this thread reaches on a bmm of the model's own shapes."""
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from benchmarks.record import best_seconds, spread
from metalearn.data import Sinusoid
from metalearn.maml import MetaLearner
from metalearn.model import MLP


def _learner(learner, batch):
    learner.zero_grad()
    learner(*batch).mean().backward()


def _vmap(learner, batch):  # one task's adaptation by torch.func.grad, vectorised over the tasks by vmap
    model, lr = learner.model, learner.inner_lr
    params = dict(model.named_parameters())

    def task_loss(weights, x, y):
        return F.mse_loss(functional_call(model, weights, (x,)), y)

    def query_loss(sx, sy, qx, qy):
        grads = grad(task_loss)(params, sx, sy)
        return task_loss({name: p - lr * grads[name] for name, p in params.items()}, qx, qy)

    learner.zero_grad()
    vmap(query_loss)(*batch).mean().backward()


def _autograd_loop(learner, batch):
    model, params = learner.model, list(learner.model.parameters())
    names = [name for name, _ in model.named_parameters()]
    learner.zero_grad()
    total = 0
    for sx, sy, qx, qy in zip(*batch):
        loss = F.mse_loss(model(sx), sy)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        fast = {n: p - learner.inner_lr * g for n, p, g in zip(names, params, grads)}
        total = total + F.mse_loss(functional_call(model, fast, (qx,)), qy)
    (total / len(batch[0])).backward()


def _higher_loop(learner, batch):
    import higher
    model = learner.model
    inner = torch.optim.SGD(model.parameters(), lr=learner.inner_lr)
    learner.zero_grad()
    for sx, sy, qx, qy in zip(*batch):
        with higher.innerloop_ctx(model, inner, copy_initial_weights=False) as (fmodel, diffopt):
            diffopt.step(F.mse_loss(fmodel(sx), sy))
            (F.mse_loss(fmodel(qx), qy) / len(batch[0])).backward()


def _finite_difference_check(learner, batch, coordinates: int = 12, eps: float = 1e-6) -> bool:
    """The loop's meta-gradient against central differences of the meta-loss, at a few random coordinates."""
    _autograd_loop(learner, batch)
    params = list(learner.model.parameters())
    grads = [p.grad.clone() for p in params]
    pick = torch.Generator().manual_seed(0)
    agree = []
    with torch.no_grad():
        for _ in range(coordinates):
            i = int(torch.randint(len(params), (), generator=pick))
            j = int(torch.randint(params[i].numel(), (), generator=pick))
            flat = params[i].view(-1)
            losses = []
            for delta in (eps, -eps):
                flat[j] += delta
                with torch.enable_grad():
                    losses.append(learner(*batch).mean().item())
                flat[j] -= delta
            numeric = (losses[0] - losses[1]) / (2 * eps)
            agree.append(abs(numeric - grads[i].view(-1)[j].item()) <= 1e-6 + 1e-5 * abs(numeric))
    return all(agree)


LOOP = "per-task autograd loop"
LEARNER = "batched (metalearn.maml)"
COMPILED = "batched + torch.compile"
HIGHER = "per-task higher loop"
_compiled = {}  # id(learner) -> torch.compile(learner), compiled once per learner (in the warm-up)


def _learner_compiled(learner, batch):  # what `python -m metalearn.train --compile` runs
    if id(learner) not in _compiled:
        _compiled[id(learner)] = torch.compile(learner)
    _learner(_compiled[id(learner)], batch)


def measure_setup(tasks: int, shots: int, queries: int, iterations: int, repeats: int, seed: int = 0) -> dict:
    methods = {LOOP: _autograd_loop, LEARNER: _learner, "vmap (torch.func)": _vmap, COMPILED: _learner_compiled}
    try:
        import higher  # noqa: F401
        methods[HIGHER] = _higher_loop
    except ImportError:
        pass
    # correctness first, in float64: the loop against finite differences, the others against the loop
    torch.manual_seed(0)
    learner = MetaLearner(MLP(1, 40, 1).double(), F.mse_loss, inner_lr=0.01)
    batch = tuple(t.double() for t in Sinusoid().sample(tasks, shots, queries, torch.Generator().manual_seed(0)))
    agree = {LOOP: _finite_difference_check(learner, batch)}
    methods[LOOP](learner, batch)
    reference = [p.grad.clone() for p in learner.model.parameters()]
    for name, method in methods.items():
        if name != LOOP:
            method(learner, batch)
            agree[name] = all(torch.allclose(p.grad, r, rtol=1e-6, atol=1e-6)
                              for p, r in zip(learner.model.parameters(), reference))
    # then speed, in float32, the methods in a new random order each repeat (repeat 0 warms up)
    learner = MetaLearner(MLP(1, 40, 1), F.mse_loss, inner_lr=0.01)
    optimizer = torch.optim.Adam(learner.parameters(), lr=1e-3)
    batches = [Sinusoid().sample(tasks, shots, queries, torch.Generator().manual_seed(i)) for i in range(iterations)]
    samples, orders = {name: [] for name in methods}, []
    shuffle = random.Random(seed).shuffle
    for repeat in range(repeats + 1):
        order = list(methods)
        shuffle(order)
        if repeat:
            orders.append(order)
        for name in order:
            count = iterations // 4 if repeat == 0 else iterations
            start = time.perf_counter()
            for batch in batches[:count]:
                methods[name](learner, batch)
                optimizer.step()
            if repeat:
                samples[name].append(count / (time.perf_counter() - start))
    median = {name: statistics.median(values) for name, values in samples.items()}
    flops = meta_iteration_flops(learner, batches[0])
    peak = bmm_peak(tasks, shots + queries, 40)
    achieved = flops * median[LEARNER]
    rows = [{"method": name, "iterations_per_s": spread(values), "speed_vs_loop": median[name] / median[LOOP],
             "speedup_of_learner": median[LEARNER] / median[name],
             "gradient_reference": "central finite differences" if name == LOOP else LOOP,
             "meta_gradient_matches": agree[name]} for name, values in samples.items()]
    return {"tasks": tasks, "shots": shots, "queries": queries, "orders": orders, "rows": rows,
            "matmul_flops_per_iteration": flops, "learner_flops_per_s": achieved, "bmm_peak_flops_per_s": peak,
            "fraction_of_peak": achieved / peak}


def meta_iteration_flops(learner, batch) -> float:
    """The matrix-multiply FLOPs of one of the learner's meta-iterations (forward, inner gradient, outer backward), as
    torch's FlopCounterMode counts them (matmuls only: elementwise work is left out, as the peak leaves it)."""
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        _learner(learner, batch)
    return float(counter.get_total_flops())


def bmm_peak(tasks: int, points: int, width: int, seconds: float = 1.0) -> float:
    """This machine's FLOP/s on the MAML model's own batched matmul, float32, on the calling thread count: a
    (tasks, points, width) @ (tasks, width, width) bmm in a loop, the best of 5 timed runs."""
    a, b = torch.randn(tasks, points, width), torch.randn(tasks, width, width)
    out = torch.empty(tasks, points, width)
    return 2.0 * tasks * points * width * width / best_seconds(lambda: torch.bmm(a, b, out=out), seconds)


def setups() -> dict:
    """(tasks, shots, queries) of the paper's sinusoid runs and of the default command (metalearn/config.py), one
    setup where they are the same."""
    from metalearn.config import Config
    paper, default = (25, 10, 10), (Config().batch_size, Config().shots, Config().queries)
    return {"default (the paper's)": paper} if default == paper else {"paper": paper, "default": default}


def measure(iterations: int = 200, repeats: int = 5) -> dict:
    torch.set_num_threads(1)
    return {"setups": {name: measure_setup(*shape, iterations, repeats) for name, shape in setups().items()}}
