"""The programs: what `draw` generates (with the refusal core must give, if any), the models and loaders they use,
and the training loop both sides run (`train`), calling the side's operations (`ops`: through core, or plain
PyTorch)."""
import copy
import pickle
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

ONE_PROCESS = ["single:32-true", "single:bf16-mixed", "single:16-mixed", "single:bf16-true"]
TWO_PROCESSES = ["ddp:32-true", "ddp:bf16-mixed", "ddp:16-mixed", "ddp:bf16-true", "fsdp:32-true",
                 "fsdp:bf16-mixed", "fsdp:bf16-true", "fsdp:16-mixed", "deepspeed_stage_1:32-true",
                 "deepspeed_stage_2:32-true", "deepspeed_stage_3:32-true", "deepspeed_stage_1:16-mixed",
                 "deepspeed_stage_2:bf16-mixed", "deepspeed_stage_3:bf16-mixed", "deepspeed_stage_1:bf16-true"]
SAMPLES, BATCH = 16, 4
# The refusals a program can be drawn to meet: name -> (the message core's error must contain, why it is right)
REFUSALS = {
    "shared optimizer": ("do not belong to the", "one optimizer over two set-up models: a checkpoint names its "
                                                 "state by one module's parameters"),
    "fsdp 16-mixed": ("is not supported with strategy='fsdp'", "FSDP2 has no sharded loss scaler"),
    "fsdp grad without optimizer": ("this model has none set up", "fabric.grad under fsdp keeps the parameters "
                                                                   "gathered until the model's optimizer steps"),
}
GRAD_KINDS = ("penalty", "penalty2", "probe")  # the iterations that call fabric.grad
# The share of programs whose last state is saved and loaded in a fresh process (python -m tests.contract.moved),
# under a cell drawn from those of the same precision: the same one, another strategy, another process count
MOVE_SHARE = 0.05


def draw(rng: random.Random, strategy: str, precision: str, move_share: float = MOVE_SHARE) -> dict:
    """One program, as plain data (JSON), from `rng`: what a user porting a script might do with core, the
    refusal core must give it (`expect`, a key of REFUSALS) or None, and the cell whose fresh process loads its
    final checkpoint (`moved`) or None."""
    deepspeed, single = strategy.startswith("deepspeed"), strategy == "single"
    # DeepSpeed's bf16 and fp16 engines convert the parameters but not the buffers, and the CPU's batch_norm takes
    # no such mix: plain DeepSpeed fails there the same way, so no BatchNorm is drawn for those cells
    norm_allowed = not deepspeed or precision == "32-true"
    models = []
    for _ in range(rng.randint(1, 3)):
        # a DeepSpeed engine has one optimizer; under fsdp a model without one is refused at its first fabric.grad,
        # so it is drawn rarely there, to leave most programs to run
        count = 1 if deepspeed else rng.choice([0, 1, 1, 1, 2] if strategy != "fsdp" else [0] + [1] * 12 + [2] * 3)
        parts = ["all"] if count == 1 else ["first", "last"][:count]
        optimizers = [{"kind": rng.choice(["sgd", "adam"]), "params": part,
                       "scheduler": rng.choice([None, None, "before", "after"])} for part in parts]
        models.append({"width": rng.choice([4, 8]), "split": not deepspeed and rng.random() < 0.3,
                       "optimizers": optimizers, "norm": norm_allowed and rng.random() < 0.3,
                       "frozen": rng.random() < 0.2,  # the user froze its first layer before setup
                       "marked": not deepspeed and rng.random() < 0.2})  # called through a marked method
    if len(models) > 1 and rng.random() < 0.05:  # one optimizer over two models: core refuses it at setup
        models[0]["optimizers"].append({"kind": "sgd", "params": "shared", "scheduler": None})
    kinds = ["each", "accumulate"] + ([] if deepspeed else ["penalty", "penalty2", "probe"])
    kinds += ["pair"] + ([] if deepspeed else ["together"]) if len(models) > 1 else []
    steps = []
    for _ in range(6):
        step = {"kind": rng.choice(kinds), "clip": None if deepspeed else rng.choice([None, None, "norm", "value"]),
                "lr_scale": rng.choice([None, None, None, 0.5]), "set_to_none": rng.random() < 0.8,
                "overflow": precision == "16-mixed" and rng.random() < 0.2,
                "checkpoint": rng.random() < 0.15, "reload_optimizer": False,
                "no_model": rng.random() < 0.3,  # fabric.backward(loss) and fabric.grad without model=
                "eval": rng.random() < 0.15,  # a forward in eval mode under no_grad, its output kept
                "reduce": rng.random() < 0.15,  # fabric.all_reduce and fabric.broadcast of the losses
                "copy": rng.choice([None, "deepcopy", "pickle"]) if single and rng.random() < 0.2 else None}
        step["reload_optimizer"] = step["checkpoint"] and not deepspeed and rng.random() < 0.5
        step["fresh"] = step["checkpoint"] and rng.random() < 0.5  # loaded into new objects, not the same ones
        steps.append(step)
    program = {"models": models, "loader": rng.choice(["shuffle", "batch_sampler", "subclass"]),
               "epochs": rng.choice([1, 2]), "steps": steps}
    program["expect"] = expected_refusal(program, strategy, precision)
    move, targets = rng.random() < move_share, move_targets(program, strategy, precision)
    program["moved"] = rng.choice(targets) if move and targets and not program["expect"] else None
    return program


def move_targets(program: dict, strategy: str, precision: str) -> list[str]:
    """The cells a fresh process can load `program`'s final checkpoint under: those of `precision` whose strategy
    takes its models and optimizers (fsdp's 16-mixed refuses every program). In bf16-true a DeepSpeed engine keeps
    float32 weights under the bfloat16 ones and the others keep none, so a checkpoint moves within either family;
    in the mixed precisions an engine keeps the layers its user froze in 16 bits only, so such a program moves to
    DeepSpeed only from DeepSpeed."""
    frozen = any(spec["frozen"] for spec in program["models"])

    def family_allows(cell: str) -> bool:
        into, out_of = cell.startswith("deepspeed"), strategy.startswith("deepspeed")
        if precision == "bf16-true":
            return into == out_of
        return not (frozen and precision != "32-true" and into and not out_of)

    return [cell for cell in ONE_PROCESS + TWO_PROCESSES if cell.endswith(f":{precision}") and family_allows(cell)
            and cell != "fsdp:16-mixed" and fits({**program, "steps": [], "moved": None}, cell.split(":")[0])]


def fits(program: dict, strategy: str, precision: str | None = None) -> bool:
    """Whether `program` is one `draw` could give for `strategy` (and `precision`, where given: a shrunk program
    must stay one)."""
    deepspeed, models = strategy.startswith("deepspeed"), program["models"]
    if precision and program.get("moved") and program["moved"] not in move_targets(program, strategy, precision):
        return False
    own = [[o for o in spec["optimizers"] if o["params"] != "shared"] for spec in models]
    if deepspeed and any(len(opts) != 1 or opts[0]["params"] != "all" or spec["split"] or spec["marked"]
                         for spec, opts in zip(models, own)):
        return False
    kinds = {"each", "accumulate"} | (set() if deepspeed else {"penalty", "penalty2", "probe"})
    kinds |= ({"pair"} | (set() if deepspeed else {"together"})) if len(models) > 1 else set()
    return all(step["kind"] in kinds and (strategy == "single" or not step["copy"])
               and (step["checkpoint"] or not step.get("fresh"))
               and not (deepspeed and (step["clip"] or step["reload_optimizer"])) for step in program["steps"])


def iterations(program: dict, world_size: int) -> list[dict]:
    """The steps each rank runs, in order: its loader gives SAMPLES / world_size samples an epoch."""
    per_epoch = -(-SAMPLES // world_size // BATCH)
    return [program["steps"][i % len(program["steps"])] for i in range(program["epochs"] * per_epoch)]


def expected_refusal(program: dict, strategy: str, precision: str) -> str | None:
    """The refusal core must give this program (a key of REFUSALS), or None: the first it meets."""
    if strategy == "fsdp" and precision == "16-mixed":
        return "fsdp 16-mixed"
    if any(o["params"] == "shared" for spec in program["models"] for o in spec["optimizers"]):
        return "shared optimizer"
    if strategy == "fsdp" and any(not spec["optimizers"] for spec in program["models"]) and \
            any(step["kind"] in GRAD_KINDS for step in iterations(program, 2)):
        return "fsdp grad without optimizer"
    return None


class Block(nn.Module):
    """(B, 4) -> (B, 4), so that models chain; with `norm`, a BatchNorm (running statistics as buffers) inside."""

    def __init__(self, width: int, norm: bool = False):
        super().__init__()
        self.first, self.last = nn.Linear(4, width), nn.Linear(width, 4)
        self.norm = nn.BatchNorm1d(width) if norm else nn.Identity()

    def forward(self, x):
        return self.last(torch.tanh(self.norm(self.first(x))))

    def score(self, x):
        """A method other than forward that runs the model (marked with mark_forward_method)."""
        return 2 * self.forward(x)


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
    models = [Block(spec["width"], spec["norm"]) for spec in program["models"]]
    for model, spec in zip(models, program["models"]):
        if spec["frozen"]:
            model.first.requires_grad_(False)
    return models


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
    seen, iteration, extra = [], 0, {"evaluated": [], "reduced": [], "copies": []}
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
            if step["eval"]:
                extra["evaluated"] += [ops.evaluate(i, x, program["models"][i]["marked"])
                                       for i in range(len(ops.set_up))]
            if step["copy"]:
                extra["copies"].append(train_a_copy(step["copy"], program["models"][0]["marked"], ops, x, y))
            losses = one_iteration(step, program["models"], ops, x, y)
            if step["reduce"]:
                extra["reduced"].append(ops.reduce(torch.stack(losses) if losses else torch.zeros(1)))
            if step["checkpoint"]:  # back to the state before this iteration: in the same objects, or new ones
                if step["fresh"]:  # models, optimizers and schedulers built and set up again, other initial weights
                    ops.rebuild()
                ops.load(tmp / f"it{iteration}")
                if step["reload_optimizer"]:
                    for (_, opts, _), states in zip(ops.set_up, snapshots):
                        for opt, state in zip(opts, states):
                            opt.load_state_dict(state)
                            for group in opt.param_groups:
                                group["lr"] *= 0.5
            iteration += 1
    return {**ops.results(), "seen": seen, **extra}


def train_a_copy(how: str, marked: bool, ops, x, y) -> dict:
    """Copy model 0 with its optimizers (`copy.deepcopy`, or a pickle round trip), train the copy one step, and
    hand back its weights: the copy must train itself, and the original must not move."""
    model, optimizers, _ = ops.set_up[0]
    pair = copy.deepcopy((model, optimizers)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, optimizers)))
    k = ops.adopt(*pair)
    try:
        ops.zero_grad(k, True)
        ops.backward(F.mse_loss(ops.forward(k, x, marked), y), k, k)
        ops.step(k)
        ops.end_of_steps()
        return {name: t.detach().float().clone() for name, t in ops.weights(k).items()}
    finally:
        ops.drop(k)


def one_iteration(step: dict, specs: list, ops, x, y) -> list:
    """One iteration of `step`; returns the losses it computed (detached)."""
    scale = float("inf") if step["overflow"] else 1.0
    indices = range(len(specs))
    marked = [spec["marked"] for spec in specs]
    model_of = (lambda i: None) if step["no_model"] else (lambda i: i)
    losses = []
    for i in indices:
        ops.zero_grad(i, step["set_to_none"])
        for opt in ops.set_up[i][1]:
            if step["lr_scale"]:
                for group in opt.param_groups:
                    group["lr"] *= step["lr_scale"]
    kind = step["kind"]
    if kind == "together":  # one loss through every model, then every optimizer
        out = x
        for i in indices:
            out = ops.forward(i, out, marked[i])
        losses.append(F.mse_loss(out, y))
        ops.backward(losses[-1] * scale, 0, model_of(0))
        finish(step, indices, ops)
    elif kind == "each":  # a loss per model, each followed by its optimizers' steps
        for i in indices:
            losses.append(F.mse_loss(ops.forward(i, x, marked[i]), y))
            ops.backward(losses[-1] * scale, i, model_of(i))
            finish(step, [i], ops)
    elif kind == "pair":  # a GAN's two steps: model 0 through model 1 frozen, then model 1 on model 0's output
        with ops.frozen(1):
            fake = ops.forward(0, x, marked[0])
            losses.append(F.mse_loss(ops.forward(1, fake, marked[1]), y))
        ops.backward(losses[-1] * scale, 0, model_of(0))
        finish(step, [0], ops)
        losses.append(F.mse_loss(ops.forward(1, fake.detach(), marked[1]), y))
        ops.backward(losses[-1], 1, model_of(1))
        finish(step, [1], ops)
    elif kind in ("penalty", "penalty2"):  # R1-style: the gradient with respect to the input, penalised, per model
        for i in indices:  # penalty2: also at a second input (R1 on reals and R2 on fakes), both before the step
            x = x.detach().requires_grad_(True)
            out = ops.forward(i, x, marked[i])
            penalty = ops.grad(out.sum(), x, i, model_of(i)).pow(2).mean()
            if kind == "penalty2":
                other = x.detach().flip(0).requires_grad_(True)
                penalty = penalty + ops.grad(ops.forward(i, other, marked[i]).sum(), other, i,
                                             model_of(i)).pow(2).mean()
            losses.append(F.mse_loss(out, y))
            ops.backward((losses[-1] + 0.1 * penalty) * scale, i, model_of(i))
            finish(step, [i], ops)
    elif kind == "probe":  # an input gradient taken and looked at, with no backward and no step after it
        for i in indices:
            x = x.detach().requires_grad_(True)
            losses.append(ops.grad(ops.forward(i, x, marked[i]).sum(), x, i, model_of(i)).pow(2).mean().detach())
    else:  # accumulate: two half batches per model, the first without gradient sync
        for i in indices:
            with ops.no_sync([i]):
                ops.backward(F.mse_loss(ops.forward(i, x[:2], marked[i]), y[:2]) * 0.5, i, model_of(i))
            losses.append(F.mse_loss(ops.forward(i, x[2:], marked[i]), y[2:]))
            ops.backward(losses[-1] * 0.5 * scale, i, model_of(i))
            finish(step, [i], ops)
    return [loss.detach().float() for loss in losses]


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


def script(program: dict, strategy: str = "STRATEGY", precision: str = "PRECISION") -> str:
    """The program as the core calls it makes, for a maintainer to read next to the replay command."""
    lines = [f"fabric = Fabric(strategy={strategy!r}, precision={precision!r})"]
    for i, spec in enumerate(program["models"]):
        opts = ", ".join(f"{o['kind']}({o['params']})" + (f" +scheduler {o['scheduler']} setup" if o["scheduler"]
                                                           else "") for o in spec["optimizers"])
        how = "setup_module + setup_optimizers" if spec["split"] else "setup"
        lines.append(f"model{i} = Block({spec['width']}{', norm' if spec['norm'] else ''})"
                     + (" with first layer frozen by its user" if spec["frozen"] else "")
                     + (", called through model.score, marked" if spec["marked"] else "")
                     + f": {how}, optimizers [{opts}]")
    lines.append(f"loader: {program['loader']}, {program['epochs']} epoch(s); iterations cycle through:")
    flags = ("clip", "lr_scale", "overflow", "checkpoint", "fresh", "reload_optimizer", "no_model", "eval", "reduce",
             "copy")
    for step in program["steps"]:
        extras = [f"{name}={step[name]}" if step[name] is not True else name for name in flags if step[name]]
        extras += [] if step["set_to_none"] else ["zero_grad(set_to_none=False)"]
        lines.append(f"  {step['kind']}" + (f" with {', '.join(extras)}" if extras else ""))
    if program.get("moved"):
        lines.append(f"then fabric.save of every object, and fabric.load into new ones (other initial weights) in a "
                     f"fresh process under {program['moved']}: the weights, learning rates and optimizer moments "
                     f"must come back bitwise")
    if program.get("expect"):
        lines.append(f"core must refuse it: {program['expect']} ({REFUSALS[program['expect']][1]})")
    return "\n".join(lines)
