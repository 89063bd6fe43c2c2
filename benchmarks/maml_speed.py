"""MAML meta-iterations per second at the paper's sinusoid setup (K=10, 40-40 ReLU MLP, 1 inner step,
alpha 0.01, meta-batch 25): the vectorised torch.func learner against a per-task
`autograd.grad(create_graph=True)` loop and, when installed, a per-task loop written with `higher`.
The meta-gradients of all three are checked to agree (allclose 1e-6, float64) before timing."""
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.record import spread
from metalearn.data import Sinusoid
from metalearn.maml import MetaLearner
from metalearn.model import MLP


def _vmap(learner, batch):
    learner.zero_grad()
    learner(*batch).mean().backward()


def _autograd_loop(learner, batch):
    model, params = learner.model, list(learner.model.parameters())
    names = [name for name, _ in model.named_parameters()]
    learner.zero_grad()
    total = 0
    for sx, sy, qx, qy in zip(*batch):
        loss = F.mse_loss(model(sx), sy)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        fast = {n: p - learner.inner_lr * g for n, p, g in zip(names, params, grads)}
        total = total + F.mse_loss(torch.func.functional_call(model, fast, (qx,)), qy)
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


def measure(iterations: int = 200, repeats: int = 5) -> dict:
    torch.set_num_threads(1)
    methods = {"vmap (torch.func)": _vmap, "per-task autograd loop": _autograd_loop}
    try:
        import higher  # noqa: F401
        methods["per-task higher loop"] = _higher_loop
    except ImportError:
        pass
    # correctness first, in float64
    torch.manual_seed(0)
    learner = MetaLearner(MLP(1, 40, 1).double(), F.mse_loss, inner_lr=0.01)
    batch = tuple(t.double() for t in Sinusoid().sample(25, 10, 10, torch.Generator().manual_seed(0)))
    reference = None
    agree = {}
    for name, method in methods.items():
        method(learner, batch)
        grads = [p.grad.clone() for p in learner.model.parameters()]
        reference = reference or grads
        agree[name] = all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(grads, reference))
    # then speed, in float32, alternating methods
    learner = MetaLearner(MLP(1, 40, 1), F.mse_loss, inner_lr=0.01)
    optimizer = torch.optim.Adam(learner.parameters(), lr=1e-3)
    batches = [Sinusoid().sample(25, 10, 10, torch.Generator().manual_seed(i)) for i in range(iterations)]
    samples = {name: [] for name in methods}
    for repeat in range(repeats + 1):
        for name, method in methods.items():
            start = time.perf_counter()
            for batch in batches[: iterations // 4 if repeat == 0 else iterations]:
                method(learner, batch)
                optimizer.step()
            if repeat:  # the first pass is the warm-up
                samples[name].append(iterations / (time.perf_counter() - start))
    vmap = statistics.median(samples["vmap (torch.func)"])
    return {"rows": [{"method": name, "iterations_per_s": spread(values), "speedup_of_vmap":
                      vmap / statistics.median(values), "meta_gradient_matches": agree[name]}
                     for name, values in samples.items()]}
