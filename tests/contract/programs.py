"""The programs: what `draw` generates, the models and loaders they use, and the training loop both sides run
(`train`), calling the side's operations (`ops`: through core, or plain PyTorch)."""
import copy
import random
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
