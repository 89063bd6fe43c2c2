"""Started by the tests under a strategy: train a tiny model N steps, split the full batch across the
processes, and compare rank 0's gathered weights with one plain process trained on the full batch.

    python tests/dist_parity.py --strategy ddp --devices 2 --out result.json
    python tests/dist_parity.py --strategy deepspeed_stage_1,deepspeed_stage_3 --optimizer sgd,adam --out r.json

Writes {"STRATEGY/OPTIMIZER": {"max_abs_diff": ..., "world_size": ..., "resumed_max_abs_diff": ...}} on rank 0,
one entry per case; all cases run in the same processes.
"""
import argparse
import json
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from core import Fabric


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def make_data():
    g = torch.Generator().manual_seed(1)
    # targets of scale 4: the first gradient's norm is 2.3, so clipping to norm 1 (DeepSpeed's default) would show
    return torch.randn(16, 4, generator=g), 4 * torch.randn(16, 2, generator=g)


def make_optimizer(params, name):
    return torch.optim.Adam(params, lr=1e-2) if name == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def plain(steps, optimizer_name):
    model = make_model()
    optimizer = make_optimizer(model.parameters(), optimizer_name)
    x, y = make_data()
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def full_weights(fabric, model):
    """Every parameter of a set-up model as a full CPU tensor, on every rank."""
    name = fabric.strategy.__class__.__name__
    if name == "FSDP":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
    if name == "DeepSpeed" and fabric.strategy.stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            return {k: v.detach().float().cpu().clone() for k, v in model.module.state_dict().items()}
    return {k: v.detach().float().cpu().clone() for k, v in model.module.state_dict().items()}


def train(fabric, model, optimizer, steps):
    x, y = make_data()
    x, y = x.chunk(fabric.world_size)[fabric.global_rank], y.chunk(fabric.world_size)[fabric.global_rank]
    x, y = fabric.to_device(x), fabric.to_device(y)
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()


def max_diff(a, b):
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in b)


def check(args, strategy, optimizer_name):
    """One case in processes this script starts (or torchrun did): (result, whether this process is rank 0)."""
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=args.devices, num_nodes=args.num_nodes)
    fabric.launch()  # the first case starts the processes; later ones find them started
    return compare(fabric, optimizer_name, args.split_setup, args.steps), fabric.is_global_zero


def compare(fabric, optimizer_name: str, split_setup: bool = False, steps: int = 5) -> dict:
    """One case on a launched Fabric: N steps on this rank's part of the batch, then save -> load -> continue,
    against one plain process on the whole batch (also a case for the tests' 2-rank groups, tests/group.py)."""
    model = make_model()
    if split_setup:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model.parameters(), optimizer_name))
    else:
        model, optimizer = fabric.setup(model, make_optimizer(model.parameters(), optimizer_name))
    train(fabric, model, optimizer, steps)
    weights = full_weights(fabric, model)

    # save -> load into a fresh model -> continue == uninterrupted run of 2 x steps
    with tempfile.TemporaryDirectory() as tmp:
        path = fabric.broadcast(f"{tmp}/ckpt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps})
        train(fabric, model, optimizer, steps)
        uninterrupted = full_weights(fabric, model)
        fresh = make_model()
        fresh, fresh_optimizer = fabric.setup(fresh, make_optimizer(fresh.parameters(), optimizer_name))
        state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
        fabric.load(path, state)
        train(fabric, fresh, fresh_optimizer, steps)
        resumed = full_weights(fabric, fresh)
        fabric.barrier()
    reference = plain(steps, optimizer_name)
    return {"max_abs_diff": max_diff(weights, reference), "world_size": fabric.world_size,
            "resumed_max_abs_diff": max_diff(resumed, uninterrupted), "step": state["step"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp", help="a strategy, or several separated by commas")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optimizer", default="adam", help="adam or sgd, or both separated by a comma")
    parser.add_argument("--split-setup", action="store_true", help="setup_module, then setup_optimizers")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    results = {}
    for strategy in args.strategy.split(","):
        for name in args.optimizer.split(","):
            results[f"{strategy}/{name}"], is_global_zero = check(args, strategy, name)
    if is_global_zero:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
