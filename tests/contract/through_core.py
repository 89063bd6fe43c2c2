"""One program through core: Fabric's setup, backward, grad, clipping, frozen, no_backward_sync, collectives,
save and load, and copies of set-up objects."""
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.contract.compare import moments, results_of
from tests.contract.programs import make_loader, make_models, make_optimizer, optimizer_params, train


def run_core(program: dict, strategy: str, precision: str, seed: int, tmp: Path, timeout: float = 120.0) -> dict:
    from core import Fabric

    if strategy == "single":
        fabric = Fabric(accelerator="cpu", precision=precision)
    else:  # the program's bound on every collective, so a program that hangs one rank fails instead
        fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision, timeout=timeout)
        fabric.launch()
    set_up = build(fabric, program, seed)
    loader = make_loader(program, fabric.world_size, fabric.global_rank, shard=False, seed=seed)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=program["loader"] != "batch_sampler")
    ops = CoreOps(fabric, set_up, rebuild=lambda: build(fabric, program, seed + 1))
    results = train(program, loader, ops, tmp)
    if program.get("moved"):  # for a fresh process to load, and what each rank held (run.check_moved)
        torch.save(moments(results), tmp / f"held{fabric.global_rank}.pt")
        ops.save(tmp / "moved.ckpt")  # (every rank has written its own before the save's collectives end)
    return results


def build(fabric, program: dict, seed: int) -> list:
    """The program's models, optimizers and schedulers, set up: [(model, [optimizers], [schedulers or None])]."""
    models = make_models(program, seed)
    set_up = []  # (model, [optimizers], [schedulers or None])
    for index, (model, spec) in enumerate(zip(models, program["models"])):
        if spec["split"]:
            model = fabric.setup_module(model)
        raw = model.module if spec["split"] else model
        optimizers = [make_optimizer(o["kind"], optimizer_params(raw, o["params"], models[index + 1:]))
                      for o in spec["optimizers"]]
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] == "before" else None
                      for opt, o in zip(optimizers, spec["optimizers"])]
        if spec["split"]:
            optimizers = [fabric.setup_optimizers(opt) for opt in optimizers]
        else:
            out = fabric.setup(model, *optimizers)
            model, optimizers = (out[0], list(out[1:])) if optimizers else (out, [])
        if spec["marked"]:
            model.mark_forward_method("score")
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] == "after" else s
                      for opt, o, s in zip(optimizers, spec["optimizers"], schedulers)]
        set_up.append((model, optimizers, schedulers))
    return set_up


class CoreOps:
    """The calls of one iteration, through core."""

    def __init__(self, fabric, set_up, rebuild):
        self.fabric, self.set_up, self._rebuild = fabric, set_up, rebuild

    def rebuild(self):
        """New models, optimizers and schedulers (other initial weights), set up by the same Fabric."""
        self.set_up = self._rebuild()

    def start_epoch(self, epoch):
        pass  # core calls set_epoch on the loader's samplers

    def zero_grad(self, i, set_to_none):
        for opt in self.set_up[i][1]:
            opt.zero_grad(set_to_none=set_to_none)

    def forward(self, i, x, marked):
        model = self.set_up[i][0]
        return model.score(x) if marked else model(x)

    def evaluate(self, i, x, marked):
        model = self.set_up[i][0]
        model.eval()
        with torch.no_grad():
            out = self.forward(i, x, marked)
        model.train()
        return out.detach().float().clone()

    @contextmanager
    def frozen(self, i):
        with self.fabric.frozen(self.set_up[i][0]):
            yield

    def no_sync(self, indices):
        return self.fabric.no_backward_sync(*[self.set_up[i][0] for i in indices])

    def backward(self, loss, i, model):
        if model is None:
            self.fabric.backward(loss)
        else:
            self.fabric.backward(loss, model=self.set_up[model][0])

    def grad(self, output, x, i, model):
        if model is None:
            return self.fabric.grad(output, x)[0]
        return self.fabric.grad(output, x, model=self.set_up[model][0])[0]

    def clip(self, i, how):
        model, optimizers, _ = self.set_up[i]
        for opt in optimizers:
            if how == "norm":
                self.fabric.clip_gradients(model, opt, max_norm=0.05, error_if_nonfinite=False)
            else:
                self.fabric.clip_gradients(model, opt, clip_val=0.01)

    def step(self, i):
        for opt in self.set_up[i][1]:
            opt.step()

    def end_of_steps(self):
        pass  # core's scaler updates before the next scaled loss

    def reduce(self, losses):
        mean = self.fabric.all_reduce(losses, reduce_op="mean")
        last = self.fabric.world_size - 1  # a source other than rank 0 where there are two
        return {"mean": mean.detach().clone(), "broadcast": self.fabric.broadcast(losses.tolist(), src=last)}

    def adopt(self, model, optimizers) -> int:
        """Take a copy of a set-up model and its optimizers in as model number k (returned), until drop(k)."""
        self.set_up.append((model, optimizers, [None] * len(optimizers)))
        return len(self.set_up) - 1

    def drop(self, k):
        del self.set_up[k]

    def weights(self, i):
        return self.set_up[i][0].module.state_dict()

    def save(self, path):
        self.fabric.save(path, self.state())

    def load(self, path):
        self.fabric.load(path, self.state())

    def state(self):
        state = {}
        for i, (model, optimizers, schedulers) in enumerate(self.set_up):
            state[f"model{i}"] = model
            for j, (opt, sched) in enumerate(zip(optimizers, schedulers)):
                state[f"optimizer{i}.{j}"] = opt
                if sched is not None:
                    state[f"scheduler{i}.{j}"] = sched
        return state

    def results(self):
        return results_of(self.fabric.strategy.name, [(m.module, [o.optimizer for o in opts], m._forward_module)
                                                      for m, opts, _ in self.set_up])
