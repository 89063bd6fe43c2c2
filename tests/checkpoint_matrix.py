"""Started by tests/test_checkpoints.py: save a checkpoint under one strategy and number of processes, or
load checkpoints saved under others, and compare.

    python tests/checkpoint_matrix.py --strategy single --plain --save DIR      # DIR/singlex1, DIR/plain
    python tests/checkpoint_matrix.py --strategy ddp,fsdp --devices 2 --save DIR  # DIR/ddpx2, DIR/fsdpx2
    python tests/checkpoint_matrix.py --strategy ddp,fsdp --devices 2 --load DIR/fsdpx2,DIR/plain --out result.json

Two models with an optimizer each (Adam, and SGD with momentum, which shows a scaled gradient), trained on
the full batch split across the processes, so every shape computes the same steps up to rounding.
--save: STEPS steps, then `fabric.save(DIR/NAME/ckpt)` (--plain: also `torch.save` of the state dicts, as the
plain scripts write, to DIR/plain), and the full weights to DIR/NAME/weights.pt.
--load: for each DIR/NAME, fresh models load its checkpoint (weights compared bitwise with its
weights.pt), train MORE steps, and are compared with models trained STEPS + MORE steps uninterrupted on
this shape. Rank 0 writes {TARGET: {NAME: {"loaded_max_diff", "continued_max_diff", "step"}}}.
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core import CheckpointError, Fabric

STEPS, MORE = 3, 3


class Net(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.hidden = nn.Linear(4, width)
        self.out = nn.Linear(width, 2)
        self.register_buffer("offset", torch.zeros(2))  # changed by training: buffers must come back too

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))) + self.offset


def build(fabric):
    torch.manual_seed(0)
    first, second = Net(16), Net(8)
    first, optimizer_1 = fabric.setup(first, torch.optim.Adam(first.parameters(), lr=1e-2))
    second, optimizer_2 = fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.05, momentum=0.9))
    return {"first": first, "optimizer_1": optimizer_1, "second": second, "optimizer_2": optimizer_2, "step": 0}


def train(fabric, state, steps):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), 4 * torch.randn(16, 2, generator=g)
    x, y = fabric.to_device(x.chunk(fabric.world_size)[fabric.global_rank]), \
        fabric.to_device(y.chunk(fabric.world_size)[fabric.global_rank])
    for _ in range(steps):
        for model, optimizer in ((state["first"], state["optimizer_1"]), (state["second"], state["optimizer_2"])):
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            with torch.no_grad():
                model.module.offset += 0.125
        state["step"] += 1


def full_weights(fabric, state) -> dict:
    """Every parameter and buffer of both models as full CPU tensors, on every rank."""
    out = {}
    for key in ("first", "second"):
        model = state[key]
        if type(fabric.strategy).__name__ == "FSDP":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            weights = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
        elif type(fabric.strategy).__name__ == "DeepSpeed" and fabric.strategy.stage == 3:
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
                weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        else:
            weights = model.module.state_dict()
        out.update({f"{key}.{name}": value.detach().float().cpu().clone() for name, value in weights.items()})
    return out


def other_shape_error(fabric, path) -> str:
    """What loading `path` into a model of another width says (every rank must fail alike)."""
    torch.manual_seed(0)
    other = Net(5)
    other, optimizer = fabric.setup(other, torch.optim.Adam(other.parameters(), lr=1e-2))
    try:
        fabric.load(path, {"first": other, "optimizer_1": optimizer}, strict=False)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, help="a strategy, or several separated by commas: all run in "
                                                          "the same processes, one after the other")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--save", help="DIR to save into: one DIR/STRATEGYxDEVICES per strategy")
    parser.add_argument("--plain", action="store_true", help="also save DIR/plain as the plain scripts do: "
                                                             "torch.save of state dicts (first strategy)")
    parser.add_argument("--load", help="DIR/NAME,... to load from")
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {}
    for strategy in args.strategy.split(","):
        fabric = Fabric(accelerator="cpu", strategy=strategy, devices=args.devices)
        fabric.launch()  # the first strategy starts the processes; later ones find them started
        name = f"{strategy}x{args.devices}"
        if args.save:
            state = build(fabric)
            train(fabric, state, STEPS)
            weights = full_weights(fabric, state)
            targets = [(Path(args.save) / name, False)] + ([(Path(args.save) / "plain", True)] if args.plain else [])
            args.plain = False
            for folder, plain in targets:
                if plain:  # optimizer state keyed by position, as torch.optim numbers it
                    folder.mkdir(parents=True, exist_ok=True)
                    torch.save({key: value.module.state_dict() if isinstance(value, nn.Module) else
                                value.state_dict() if hasattr(value, "state_dict") else value
                                for key, value in state.items()}, folder / "ckpt")
                else:
                    fabric.save(folder / "ckpt", state)
                if fabric.is_global_zero:
                    torch.save(weights, folder / "weights.pt")
            fabric.barrier()
            continue

        uninterrupted = build(fabric)
        train(fabric, uninterrupted, STEPS + MORE)
        reference = full_weights(fabric, uninterrupted)
        results[name] = {}
        for source in args.load.split(","):
            state = build(fabric)
            fabric.load(Path(source) / "ckpt", state)
            loaded = full_weights(fabric, state)
            saved = torch.load(Path(source) / "weights.pt", weights_only=True)
            step = state["step"]
            train(fabric, state, MORE)
            results[name][Path(source).name] = {"loaded_max_diff": max_diff(loaded, saved), "step": step,
                                                "continued_max_diff": max_diff(full_weights(fabric, state),
                                                                               reference),
                                                "other_shape": other_shape_error(fabric, Path(source) / "ckpt")}
        fabric.barrier()
    if args.load and fabric.is_global_zero:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
