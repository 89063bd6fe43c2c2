"""core's contract, tested by generated programs: each program runs through core and as the plain PyTorch that
does the same (DDP, FSDP2 and DeepSpeed engines, autocast and one GradScaler written out), and the two must end
with bitwise equal weights, optimizer state, learning rates and data order, or core must refuse a call with its
own error (a ValueError, TypeError or RuntimeError raised in core/ that says what to do instead).

    python -m tests.contract --seed 0 --count 50                 # every one-process cell, 50 programs each
    python -m tests.contract --seed 0 --count 10 --devices 2     # ddp, fsdp, deepspeed 1-3 on 2 processes
    python -m tests.contract --seed 0 --count 10 --devices 2 --cells ddp:16-mixed --index 7   # one program

A program (`draw`) is 1-3 small models, each set up jointly or with setup_module + setup_optimizers, with 0-2
optimizers (SGD, so a scaled or clipped gradient shows, or Adam) over all or part of its parameters, a step-LR
scheduler built before or after setup; a loader shuffled by its sampler, by a DistributedSampler inside a
BatchSampler, or a DataLoader subclass, for 1-2 epochs; and per iteration one of: one loss through every model,
a loss per model, a GAN-style pair (the second model frozen in the first's step), or gradient accumulation under
no_backward_sync; with clipping by norm or value, an lr edit through param_groups, zero_grad(set_to_none=False),
an overflowing loss (16-mixed), a save then load that rewinds the iteration, and an optimizer's load_state_dict
after that load. A failing program prints as the core script it ran, with the command that replays it.
"""
import argparse
import copy
import json
import logging
import random
import sys
import tempfile
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

ONE_PROCESS = ["single:32-true", "single:bf16-mixed", "single:16-mixed", "single:bf16-true"]
# (fsdp:16-mixed and DeepSpeed's float16 on the CPU are refused by Fabric(): cells of refusals only)
TWO_PROCESSES = ["ddp:32-true", "ddp:bf16-mixed", "ddp:16-mixed", "ddp:bf16-true", "fsdp:32-true",
                 "fsdp:bf16-mixed", "fsdp:bf16-true", "fsdp:16-mixed", "deepspeed_stage_1:32-true",
                 "deepspeed_stage_2:32-true", "deepspeed_stage_3:32-true", "deepspeed_stage_1:16-mixed",
                 "deepspeed_stage_2:bf16-mixed", "deepspeed_stage_3:bf16-mixed", "deepspeed_stage_1:bf16-true"]
SAMPLES, BATCH = 16, 4
CORE = str(Path(__file__).resolve().parent.parent / "core")


# --- programs ------------------------------------------------------------------------------------------------
def draw(rng: random.Random, strategy: str, precision: str) -> dict:
    """One program, as plain data (JSON), from `rng`: what a user porting a script might do with core."""
    deepspeed = strategy.startswith("deepspeed")
    models = []
    for _ in range(rng.randint(1, 3)):
        count = 1 if deepspeed else rng.choice([0, 1, 1, 1, 2])  # a DeepSpeed engine has one optimizer
        parts = ["all"] if count == 1 else ["first", "last"][:count]
        optimizers = [{"kind": rng.choice(["sgd", "adam"]), "params": part,
                       "scheduler": rng.choice([None, None, "before", "after"])} for part in parts]
        models.append({"width": rng.choice([4, 8]), "split": not deepspeed and rng.random() < 0.3,
                       "optimizers": optimizers})
    if len(models) > 1 and rng.random() < 0.05:  # one optimizer over two models: core refuses it at setup
        models[0]["optimizers"].append({"kind": "sgd", "params": "shared", "scheduler": None})
    kinds = ["each", "pair", "accumulate"] + ([] if deepspeed else ["together", "penalty"])
    steps = []
    for _ in range(6):
        step = {"kind": rng.choice(kinds), "clip": None if deepspeed else rng.choice([None, None, "norm", "value"]),
                "lr_scale": rng.choice([None, None, None, 0.5]), "set_to_none": rng.random() < 0.8,
                "overflow": precision == "16-mixed" and rng.random() < 0.2,
                "checkpoint": rng.random() < 0.15, "reload_optimizer": False}
        step["reload_optimizer"] = step["checkpoint"] and not deepspeed and rng.random() < 0.5
        steps.append(step)
    return {"models": models, "loader": rng.choice(["shuffle", "batch_sampler", "subclass"]),
            "epochs": rng.choice([1, 2]), "steps": steps}


class Block(nn.Module):
    """(B, 4) -> (B, 4), so that models chain."""

    def __init__(self, width: int):
        super().__init__()
        self.first, self.last = nn.Linear(4, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


class Scaled(DataLoader):
    """A DataLoader subclass with an argument of its own."""

    def __init__(self, dataset, scale, **kwargs):
        super().__init__(dataset, **kwargs)
        self.scale = scale

    def __iter__(self):
        for index, x, y in super().__iter__():
            yield index, x * self.scale, y


def make_models(program: dict, seed: int) -> list:
    torch.manual_seed(seed)
    return [Block(spec["width"]) for spec in program["models"]]


def optimizer_params(model: nn.Module, part: str, others=()) -> list:
    if part == "shared":  # this model's and the next one's
        return [*model.parameters(), *others[0].parameters()]
    return list(model.parameters()) if part == "all" else list(getattr(model, part).parameters())


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.Adam(params, lr=0.01)


def make_loader(program: dict, world_size: int, rank: int, shard: bool, seed: int) -> DataLoader:
    """The loader a user builds. `shard`: the plain side, which shards by hand what core shards itself."""
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 4, generator=g),
                            torch.randn(SAMPLES, 4, generator=g))
    if program["loader"] == "batch_sampler":  # sharded by its user, as core's error for a batch sampler asks
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=5)
        return DataLoader(dataset, batch_sampler=BatchSampler(sampler, BATCH, drop_last=False))
    if shard and world_size > 1:  # what core puts in place of a RandomSampler: seeded with seed_everything's (0)
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=0)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    if program["loader"] == "subclass":
        return Scaled(dataset, 2.0, batch_size=BATCH, sampler=sampler)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


# --- one program through core ----------------------------------------------------------------------------------
class Refused(Exception):
    """core refused a call with its own error."""


def core_error(error: BaseException) -> bool:
    """A refusal core raised itself, with a message, of a kind a user can act on."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, (ValueError, TypeError, RuntimeError)) and bool(frames) and \
        frames[-1].filename.startswith(CORE) and len(str(error)) > 20


def run_core(program: dict, strategy: str, precision: str, seed: int, tmp: Path) -> dict:
    from core import Fabric

    if strategy == "single":
        fabric = Fabric(accelerator="cpu", precision=precision)
    else:  # a bound on every collective, so a program that hangs one rank fails instead
        fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision, timeout=120)
        fabric.launch()
    models = make_models(program, seed)
    before, after, set_up = [], [], []  # schedulers built before setup; after; (model, [optimizers], [scheds])
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
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] == "after" else s
                      for opt, o, s in zip(optimizers, spec["optimizers"], schedulers)]
        set_up.append((model, optimizers, schedulers))
    loader = make_loader(program, fabric.world_size, fabric.global_rank, shard=False, seed=seed)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=program["loader"] != "batch_sampler")
    ops = CoreOps(fabric, set_up)
    return train(program, loader, ops, tmp)


class CoreOps:
    """The calls of one iteration, through core."""

    def __init__(self, fabric, set_up):
        self.fabric, self.set_up = fabric, set_up

    def start_epoch(self, epoch):
        pass  # core calls set_epoch on the loader's samplers

    def zero_grad(self, i, set_to_none):
        for opt in self.set_up[i][1]:
            opt.zero_grad(set_to_none=set_to_none)

    def forward(self, i, x):
        return self.set_up[i][0](x)

    @contextmanager
    def frozen(self, i):
        with self.fabric.frozen(self.set_up[i][0]):
            yield

    def no_sync(self, indices):
        return self.fabric.no_backward_sync(*[self.set_up[i][0] for i in indices])

    def backward(self, loss, i):
        self.fabric.backward(loss, model=self.set_up[i][0])

    def grad(self, output, x, i):
        return self.fabric.grad(output, x, model=self.set_up[i][0])[0]

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


# --- one iteration, the same code for both sides ----------------------------------------------------------------
def train(program: dict, loader, ops, tmp: Path) -> dict:
    seen, iteration = [], 0
    for epoch in range(program["epochs"]):
        ops.start_epoch(epoch)
        for index, x, y in loader:
            seen += index.tolist()
            step = program["steps"][iteration % len(program["steps"])]
            if step["checkpoint"]:
                ops.save(tmp / f"it{iteration}")
                # copied now: a state_dict holds the optimizer's live tensors, which the steps change in place
                snapshots = [[copy.deepcopy(opt.state_dict()) for opt in opts] for _, opts, _ in ops.set_up] \
                    if step["reload_optimizer"] else None
            one_iteration(step, len(ops.set_up), ops, x, y)
            if step["checkpoint"]:  # back to the state before this iteration
                ops.load(tmp / f"it{iteration}")
                if step["reload_optimizer"]:
                    for (_, opts, _), states in zip(ops.set_up, snapshots):
                        for opt, state in zip(opts, states):
                            opt.load_state_dict(state)
                            for group in opt.param_groups:
                                group["lr"] *= 0.5
            iteration += 1
    return {**ops.results(), "seen": seen}


def one_iteration(step: dict, count: int, ops, x, y) -> None:
    scale = float("inf") if step["overflow"] else 1.0
    indices = range(count)
    for i in indices:
        ops.zero_grad(i, step["set_to_none"])
        for opt in ops.set_up[i][1]:
            if step["lr_scale"]:
                for group in opt.param_groups:
                    group["lr"] *= step["lr_scale"]
    kind = step["kind"] if count > 1 or step["kind"] in ("each", "accumulate") else "each"
    if kind == "together":  # one loss through every model, then every optimizer
        out = x
        for i in indices:
            out = ops.forward(i, out)
        ops.backward(F.mse_loss(out, y) * scale, 0)
        finish(step, indices, ops)
    elif kind == "each":  # a loss per model, each followed by its optimizers' steps
        for i in indices:
            ops.backward(F.mse_loss(ops.forward(i, x), y) * scale, i)
            finish(step, [i], ops)
    elif kind == "pair":  # a GAN's two steps: model 0 through model 1 frozen, then model 1 on model 0's output
        with ops.frozen(1):
            fake = ops.forward(0, x)
            loss = F.mse_loss(ops.forward(1, fake), y)
        ops.backward(loss * scale, 0)
        finish(step, [0], ops)
        ops.backward(F.mse_loss(ops.forward(1, fake.detach()), y), 1)
        finish(step, [1], ops)
    elif kind == "penalty":  # R1-style: the gradient with respect to the input, penalised, per model
        for i in indices:
            x = x.detach().requires_grad_(True)
            out = ops.forward(i, x)
            penalty = ops.grad(out.sum(), x, i).pow(2).mean()
            ops.backward((F.mse_loss(out, y) + 0.1 * penalty) * scale, i)
            finish(step, [i], ops)
    else:  # accumulate: two half batches per model, the first without gradient sync
        for i in indices:
            with ops.no_sync([i]):
                ops.backward(F.mse_loss(ops.forward(i, x[:2]), y[:2]) * 0.5, i)
            ops.backward(F.mse_loss(ops.forward(i, x[2:]), y[2:]) * 0.5 * scale, i)
            finish(step, [i], ops)


def finish(step: dict, indices, ops) -> None:
    for i in indices:
        if step["clip"]:
            ops.clip(i, step["clip"])
        ops.step(i)
    ops.end_of_steps()
    for i in indices:
        for scheduler in ops.set_up[i][2]:
            if scheduler is not None:
                scheduler.step()


# --- the same program in plain PyTorch ---------------------------------------------------------------------------
def run_plain(program: dict, strategy: str, precision: str, seed: int, tmp: Path) -> dict:
    import torch.distributed as dist

    distributed = strategy != "single"
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    engines = strategy.startswith("deepspeed")
    models = make_models(program, seed)
    if precision == "bf16-true" and not engines:  # a DeepSpeed engine converts the module itself
        models = [m.to(torch.bfloat16) for m in models]
    set_up = []
    for index, (model, spec) in enumerate(zip(models, program["models"])):
        raw = [(o, make_optimizer(o["kind"], optimizer_params(model, o["params"], models[index + 1:])))
               for o in spec["optimizers"]]
        wrapper = model
        if strategy == "ddp" and any(p.requires_grad for p in model.parameters()):
            wrapper = nn.parallel.DistributedDataParallel(model)
        elif strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            options = {"mesh": init_device_mesh("cpu", (world,))}
            if precision == "bf16-mixed":
                options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            fully_shard(model, **options)
            raw = [(o, make_optimizer(o["kind"], optimizer_params(model, o["params"]))) for o, _ in raw]
        elif strategy.startswith("deepspeed"):
            import deepspeed
            config = {"zero_optimization": {"stage": int(strategy[-1])}, "gradient_clipping": 0.0,
                      "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                      "managed_gradient_accumulation": False, "zero_allow_untested_optimizer": True,
                      "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**31}
            if precision.startswith("bf16"):  # DeepSpeed's bf16: bfloat16 weights, float32 master weights
                config["bf16"] = {"enabled": True}
            # the scheduler built before the engine schedules the optimizer the engine steps
            optimizers = [opt for _, opt in raw]
            schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] else None
                          for o, opt in raw]
            wrapper = deepspeed.initialize(model=model, optimizer=optimizers[0] if optimizers else None,
                                           config=config, dist_init_required=False)[0]
            set_up.append((model, optimizers, schedulers, wrapper))
            continue
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if o["scheduler"] else None for o, opt in raw]
        set_up.append((model, [opt for _, opt in raw], schedulers, wrapper))
    loader = make_loader(program, world, rank, shard=True, seed=seed)
    ops = PlainOps(strategy, precision, set_up, loader)
    return train(program, loader, ops, tmp)


class PlainOps:
    """The calls of one iteration, in plain PyTorch."""

    def __init__(self, strategy, precision, set_up, loader):
        self.strategy, self.precision, self.loader = strategy, precision, loader
        self.engines = strategy.startswith("deepspeed")
        self.set_up = [(model, opts, scheds) for model, opts, scheds, _ in set_up]
        self.wrappers = [wrapper for *_, wrapper in set_up]
        self.frozen_model = None
        self.scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
        self.stepped = False
        self.release = []  # fsdp modules kept gathered for a penalty's second backward

    def start_epoch(self, epoch):
        for sampler in (self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)):
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)

    def zero_grad(self, i, set_to_none):
        if not self.engines:  # an engine's step clears its gradients itself
            for opt in self.set_up[i][1]:
                opt.zero_grad(set_to_none=set_to_none)

    def forward(self, i, x):
        model = self.set_up[i][0]
        call = model if self.frozen_model == i else self.wrappers[i]  # frozen: around the DDP wrapper
        if self.precision == "bf16-true" or (self.engines and self.precision.startswith("bf16")):
            return call(x.to(torch.bfloat16)).float()
        if self.precision in ("bf16-mixed", "16-mixed"):
            with torch.autocast("cpu", dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16):
                return call(x).float()
        return call(x)

    @contextmanager
    def frozen(self, i):
        params = [p for p in self.set_up[i][0].parameters() if p.requires_grad]
        for p in params:
            p.requires_grad_(False)
        self.frozen_model = i
        try:
            yield
        finally:
            self.frozen_model = None
            for p in params:
                p.requires_grad_(True)

    @contextmanager
    def no_sync(self, indices):
        with ExitStack() as stack:
            for i in indices:
                wrapper = self.wrappers[i]
                if isinstance(wrapper, nn.parallel.DistributedDataParallel):
                    stack.enter_context(wrapper.no_sync())
                elif self.strategy == "fsdp":
                    wrapper.set_requires_gradient_sync(False)
                    stack.callback(wrapper.set_requires_gradient_sync, True)
            yield

    def backward(self, loss, i):
        if self.engines:
            return self.wrappers[i].backward(loss)
        if self.scaler is not None:
            self.update_scale()
            loss = self.scaler.scale(loss)
        loss.backward()

    def grad(self, output, x, i):
        if self.strategy == "fsdp":  # keep the gathered parameters for the second backward, until the step
            model, optimizers, _ = self.set_up[i]
            shards = [m for m in model.modules() if hasattr(m, "set_reshard_after_backward")]
            for shard in shards:
                shard.set_reshard_after_backward(False, recurse=False)
            self.release.extend(shards)
        if self.scaler is None:
            return torch.autograd.grad(output, x, create_graph=True)[0]
        self.update_scale()
        return torch.autograd.grad(self.scaler.scale(output), x, create_graph=True)[0] / self.scaler.get_scale()

    def update_scale(self):
        if self.stepped:  # the update after the previous backward's steps
            self.scaler.update()
            self.stepped = False

    def clip(self, i, how):
        model, optimizers, _ = self.set_up[i]
        for opt in optimizers:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            if how == "norm":
                torch.nn.utils.clip_grad_norm_(params, 0.05)
            elif any(p.grad is not None for p in params):
                torch.nn.utils.clip_grad_value_([p for p in params if p.grad is not None], 0.01)

    def step(self, i):
        if self.engines:
            return self.wrappers[i].step()
        for opt in self.set_up[i][1]:
            if self.scaler is not None:
                self.scaler.step(opt)
                self.stepped = True
            else:
                opt.step()

    def end_of_steps(self):
        for shard in self.release:
            shard.reshard()
            shard.set_reshard_after_backward(True, recurse=False)
        self.release = []

    def save(self, path):
        if self.engines:
            for i, engine in enumerate(self.wrappers):
                engine.save_checkpoint(str(path), tag=f"model{i}")
            self.snapshot = [[s.state_dict() if s else None for s in scheds] for _, _, scheds in self.set_up]
            return
        if self.scaler is not None:
            self.update_scale()
        self.snapshot = copy.deepcopy((
            [model_state(self.strategy, m) for m, _, _ in self.set_up],
            [[optimizer_state(self.strategy, m, o) for o in opts] for m, opts, _ in self.set_up],
            [[s.state_dict() if s else None for s in scheds] for _, _, scheds in self.set_up],
            self.scaler.state_dict() if self.scaler is not None else None))

    def load(self, path):
        if self.engines:
            for i, engine in enumerate(self.wrappers):
                engine.load_checkpoint(str(path), tag=f"model{i}")
            for (_, _, scheds), states in zip(self.set_up, self.snapshot):
                for s, state in zip(scheds, states):
                    if s is not None:
                        s.load_state_dict(state)
            return
        models, optimizers, schedulers, scaler = copy.deepcopy(self.snapshot)
        for (m, opts, scheds), mstate, ostates, sstates in zip(self.set_up, models, optimizers, schedulers):
            load_model_state(self.strategy, m, mstate)
            for o, state in zip(opts, ostates):
                load_optimizer_state(self.strategy, m, o, state)
            for s, state in zip(scheds, sstates):
                if s is not None:
                    s.load_state_dict(state)
        if self.scaler is not None:
            self.update_scale()
            self.scaler.load_state_dict(scaler)

    def results(self):
        return results_of(self.strategy, [(m, opts, w) for (m, opts, _), w in zip(self.set_up, self.wrappers)])


def model_state(strategy, model):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model)
    return model.state_dict()


def load_model_state(strategy, model, state):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        return set_model_state_dict(model, state)
    model.load_state_dict(state)


def optimizer_state(strategy, model, optimizer):
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(model, optimizer)
    return optimizer.state_dict()


def load_optimizer_state(strategy, model, optimizer, state):
    if strategy == "fsdp" and not state["state"]:  # saved before the first step: torch's loader refuses it
        optimizer.state.clear()
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update({key: value for key, value in saved.items() if key != "params"})
    elif strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        return set_optimizer_state_dict(model, optimizer, state)
    optimizer.load_state_dict(state)


def results_of(strategy: str, models) -> dict:
    """Every model's full weights, each optimizer's state and learning rates, on every rank."""
    out = {}
    for i, (model, optimizers, wrapper) in enumerate(models):
        if strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)
            full = StateDictOptions(full_state_dict=True)
            weights = get_model_state_dict(model, options=full)
            states = [get_optimizer_state_dict(model, opt, options=full)["state"] for opt in optimizers]
        elif strategy.startswith("deepspeed"):
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=strategy.endswith("3")):
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            states = []  # ZeRO's flat partitions: compared through the weights they give
        else:
            weights = model.state_dict()
            states = [opt.state_dict()["state"] for opt in optimizers]
        out[f"model{i}"] = {k: v.detach().float().cpu().clone() for k, v in weights.items()}
        for j, (opt, state) in enumerate(zip(optimizers, states)):
            out[f"optimizer{i}.{j}"] = {"lr": [g["lr"] for g in opt.param_groups],
                                        "state": {str(k): {n: t.detach().float().cpu().clone() if torch.is_tensor(t)
                                                           else t for n, t in v.items()} for k, v in state.items()}}
    return out


def differences(core, plain, prefix="") -> list[str]:
    """Where two results differ (bitwise), as short lines."""
    if isinstance(core, dict) and isinstance(plain, dict):
        if set(core) != set(plain):
            return [f"{prefix}: keys {sorted(map(str, core))} vs {sorted(map(str, plain))}"]
        return [line for key in core for line in differences(core[key], plain[key], f"{prefix}.{key}".strip("."))]
    if torch.is_tensor(core) and torch.is_tensor(plain):
        if core.shape == plain.shape and torch.equal(core, plain):
            return []
        gap = (core - plain).abs().max().item() if core.shape == plain.shape else "shape"
        return [f"{prefix}: max difference {gap}"]
    return [] if core == plain else [f"{prefix}: {core} vs {plain}"]


# --- running programs ---------------------------------------------------------------------------------------
def check(program: dict, strategy: str, precision: str, seed: int) -> tuple[str, str]:
    """("ok" | "refused" | "failed", detail) for one program."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return check_in(program, strategy, precision, seed, Path(tmp))
        finally:
            if strategy != "single":  # rank 0's folder is removed only when every rank is done with it
                import torch.distributed as dist
                dist.barrier()


def check_in(program: dict, strategy: str, precision: str, seed: int, tmp: Path) -> tuple[str, str]:
    """check() inside its temporary folder `tmp` (rank 0's, on every rank)."""
    if strategy != "single":  # every rank writes into rank 0's folder
        import torch.distributed as dist
        box = [str(tmp)]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
    for side in ("core", "plain"):
        (tmp / side).mkdir(exist_ok=True)
    try:
        core = run_core(program, strategy, precision, seed, tmp / "core")
    except Exception as error:  # noqa: BLE001 - classified below
        if core_error(error):
            return "refused", f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return "failed", "core crashed:\n" + traceback.format_exc(limit=-6)
    try:
        plain = run_plain(program, strategy, precision, seed, tmp / "plain")
    except Exception:  # noqa: BLE001
        return "failed", "the plain program crashed (a harness error):\n" + traceback.format_exc(limit=-6)
    lines = differences(core, plain)
    return ("ok", "") if not lines else ("failed", "core and plain differ:\n  " + "\n  ".join(lines[:12]))


def script(program: dict) -> str:
    """The program as the core calls it makes, for a maintainer to read next to the replay command."""
    lines = ["fabric = Fabric(strategy=STRATEGY, precision=PRECISION)"]
    for i, spec in enumerate(program["models"]):
        opts = ", ".join(f"{o['kind']}({o['params']})" + (f" +scheduler {o['scheduler']} setup" if o["scheduler"]
                                                           else "") for o in spec["optimizers"])
        how = "setup_module + setup_optimizers" if spec["split"] else "setup"
        lines.append(f"model{i} = Block({spec['width']}): {how}, optimizers [{opts}]")
    lines.append(f"loader: {program['loader']}, {program['epochs']} epoch(s); iterations cycle through:")
    for step in program["steps"]:
        extras = [name for name in ("clip", "lr_scale", "overflow", "checkpoint", "reload_optimizer") if step[name]]
        extras += [] if step["set_to_none"] else ["zero_grad(set_to_none=False)"]
        lines.append(f"  {step['kind']}" + (f" with {', '.join(f'{e}={step[e]}' if e in step else e for e in extras)}"
                                             if extras else ""))
    return "\n".join(lines)


def run_cells(cells: list[str], seed: int, count: int, index: int | None = None, out=sys.stdout) -> dict:
    """Run `count` programs in each cell ("strategy:precision"), all in this process group; return the counts,
    and print each failure with its script and replay command."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    totals = {"ok": 0, "refused": 0, "failed": 0}
    refusals = {}
    for cell in cells:
        strategy, precision = cell.split(":")
        for i in range(count) if index is None else [index]:
            rng = random.Random(f"{seed}:{cell}:{i}")
            program = draw(rng, strategy, precision)
            verdict, detail = check(program, strategy, precision, seed * 1000 + i)
            if distributed or strategy != "single":
                import torch.distributed as dist
                verdicts = [None] * dist.get_world_size()
                dist.all_gather_object(verdicts, (verdict, detail))
                worst = next((v for v in verdicts if v[0] == "failed"), verdicts[0])
                verdict, detail = worst
            totals[verdict] += 1
            if verdict == "refused":
                refusals[detail] = refusals.get(detail, 0) + 1
            if verdict == "failed" and rank == 0:
                print(f"\nFAILED {cell} program {i}: {detail}\n{script(program)}\nreplay: python -m tests.contract "
                      f"--seed {seed} --cells {cell} --index {i}" + (" --devices 2" if strategy != "single" else "")
                      + f"\nprogram: {json.dumps(program)}", file=out, flush=True)
    return {**totals, "refusals": refusals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--count", type=int, default=20, help="programs per cell")
    parser.add_argument("--devices", type=int, default=1, choices=[1, 2],
                        help="1: the one-process cells; 2: the distributed cells, on 2 processes")
    parser.add_argument("--cells", default=None,
                        help="comma-separated strategy:precision cells (default: every cell for --devices)")
    parser.add_argument("--index", type=int, default=None, help="run only this program of each cell (a replay)")
    args = parser.parse_args(argv)
    cells = args.cells.split(",") if args.cells else (ONE_PROCESS if args.devices == 1 else TWO_PROCESSES)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")  # programs may
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its "untested optimizer" line, once an engine
    if args.devices == 2:
        from core import Fabric
        Fabric(accelerator="cpu", strategy="ddp", devices=2).launch()  # the process group every program shares
    result = run_cells(cells, args.seed, args.count, args.index)
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0  # rank 0 reports for every rank
    print(json.dumps(result, indent=1), flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
