"""3 SGD steps of a small conv discriminator with an R1 penalty (weight 5) taken through `fabric.grad`, the batch
of 8 split across the processes; the whole weights come back. tests/test_gradient_penalty.py runs it on 2 ranks of
the session's group (tests/group.py) and, as the reference, on one process; this command runs the one-process
reference of a strategy that needs its own process (DeepSpeed's engine on one device):

    python tests/penalty_parity.py --strategy deepspeed_stage_2 --precision bf16-mixed --out w.pt
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

from core import Fabric, checkpoint


def discriminator():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(8, 16, 4, 2, 1), nn.LeakyReLU(0.2),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 1))


def train(fabric, path: str) -> dict:
    """The penalised steps under `fabric` (made with needs={"second_backward"}: the penalty's backward runs through
    its gradient, so ZeRO-2 keeps its gradients apart); the whole weights, saved through `path`."""
    module = discriminator()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.05))
    images = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    share = len(images) // fabric.world_size
    for _ in range(3):
        real = images[fabric.global_rank * share:(fabric.global_rank + 1) * share].clone().requires_grad_(True)
        logits = model(real)
        (gradient,) = fabric.grad(logits.sum(), real)
        penalty = 5 / 2 * gradient.pow(2).sum([1, 2, 3]).mean()
        optimizer.zero_grad()
        fabric.backward(F.softplus(-logits).mean() + penalty)
        optimizer.step()
    fabric.save(path, {"model": model})  # whole weights, whatever the strategy holds
    fabric.barrier()
    return checkpoint.read(path)["model"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", strategy=args.strategy, devices=1, precision=args.precision,
                    needs={"second_backward"})
    fabric.launch()
    torch.save(train(fabric, f"{args.out}.ckpt"), args.out)


if __name__ == "__main__":
    main()
