"""Started by tests/test_gradient_penalty.py: 3 SGD steps of a small conv discriminator with an R1 penalty
(weight 5) taken through `fabric.grad`, the batch of 8 split across the processes; rank 0 writes the final
weights. One process on the whole batch (strategy single) is the reference.

    torchrun --nproc-per-node 2 tests/penalty_parity.py --strategy fsdp --precision bf16-mixed --out w.pt
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # the penalty's backward runs through its gradient: said up front, so that ZeRO-2 keeps its gradients apart
    fabric = Fabric(accelerator="cpu", strategy=args.strategy, devices=args.devices, precision=args.precision,
                    needs={"second_backward"})
    fabric.launch()
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
    fabric.save(f"{args.out}.ckpt", {"model": model})  # whole weights, whatever the strategy holds
    if fabric.global_rank == 0:
        torch.save(checkpoint.read(f"{args.out}.ckpt")["model"], args.out)


if __name__ == "__main__":
    main()
