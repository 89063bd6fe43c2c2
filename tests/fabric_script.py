"""A training script written the way Lightning Fabric's documentation shows, run on core or on Lightning:

    python tests/fabric_script.py --impl core --devices 2 --out result.json
    python tests/fabric_script.py --impl lightning --devices 2 --out result.json

Only the import differs. It uses seed_everything, launch, rank_zero_first, init_module, setup with a
LightningModule-style training_step, setup_dataloaders (the injected DistributedSampler), backward,
clip_gradients, all_reduce, all_gather over a dict, log_dict, call, save and load; rank 0 writes the
loss of every step and the final weights to --out.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 16))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch):
        x, _ = batch
        return F.mse_loss(self.decoder(self.encoder(x)), x)  # the children, called inside the step method


class EpochRecorder:
    def __init__(self):
        self.epochs = []

    def on_train_epoch_end(self, epoch):  # fabric.call passes `losses` too; this callback does not take it
        self.epochs.append(epoch)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("core", "lightning"), required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss-in-forward", action="store_true", help="model(x) instead of model.training_step(batch): "
                        "Lightning runs a plain module's training_step outside autocast, core inside")
    args = parser.parse_args()

    if args.impl == "core":
        from core.compat import CSVLogger, Fabric
    else:
        from lightning.fabric import Fabric
        from lightning.fabric.loggers import CSVLogger

    recorder = EpochRecorder()
    root = os.path.dirname(os.path.abspath(args.out))
    fabric = Fabric(accelerator="cpu", devices=args.devices, precision=args.precision,
                    loggers=CSVLogger(os.path.join(root, "logs")), callbacks=[recorder])
    fabric.launch()
    fabric.seed_everything(42)

    with fabric.rank_zero_first():
        generator = torch.Generator().manual_seed(0)
        dataset = TensorDataset(torch.randn(96, 16, generator=generator), torch.zeros(96))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))

    with fabric.init_module():
        model = AutoEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)

    losses, step = [], 0
    for epoch in range(2):
        for batch in loader:
            optimizer.zero_grad()
            if args.loss_in_forward:
                loss = F.mse_loss(model(batch[0]), batch[0])
            else:
                loss = model.training_step(batch)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
            fabric.log_dict({"loss": mean_loss, "epoch": epoch}, step=step)
            losses.append(mean_loss.item())
            step += 1
        fabric.call("on_train_epoch_end", epoch=epoch, losses=losses)

    gathered = fabric.all_gather({"rank": torch.tensor([fabric.global_rank])})
    checkpoint = os.path.join(root, f"{args.impl}.ckpt")
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step})
    restored = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(checkpoint, restored)
    fabric.barrier()
    if fabric.global_rank == 0:
        result = {"losses": losses, "epochs": recorder.epochs, "world_size": fabric.world_size,
                  "ranks": gathered["rank"].flatten().tolist(), "step": restored["step"],
                  "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
