"""Autoencoder: encoder + decoder grouped in one module, one optimizer with a param group each.

    python -m autoencoder.train
    python -m autoencoder.train --strategy ddp --devices 2     # also fsdp, deepspeed_stage_2, ...

`sdiff autoencoder/train_torch.py autoencoder/train.py` shows what core replaces.
"""
import time

import torch
import torch.nn.functional as F

from autoencoder.config import Config
from autoencoder.data import CHANNELS, load_splits, make_loader
from autoencoder.model import AutoEncoder
from autoencoder.report import evaluate, finish
from common.bookkeeping import Bookkeeping
from common.config import cli
from common.rundir import RunDir
from common.steps import accumulated, lr_scheduler
from common.stopping import StopRequests
from core import Fabric
from core.cli import FabricFlags


def main(config: Config) -> dict:
    fabric = Fabric(**config.fabric_options())
    fabric.launch()
    rank, world_size, device = fabric.global_rank, fabric.world_size, fabric.device
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    run = RunDir(config.out, "autoencoder", write=rank == 0, collectives=fabric, resume=config.resume)

    train_set, test_set = load_splits(config.dataset, config.data_root, config.image_size, config.download)
    loader = make_loader(train_set, config.batch_size, config.seed, config.num_workers, rank, world_size,
                         pin_memory=device.type == "cuda")  # page-locked batches copy to the GPU asynchronously
    loader = fabric.setup_dataloaders(loader)

    model = AutoEncoder(CHANNELS[config.dataset], config.latent, config.image_size, config.width)
    optimizer = torch.optim.Adam([{"params": model.encoder.parameters(), "lr": config.lr_encoder},
                                  {"params": model.decoder.parameters(), "lr": config.lr_decoder}])
    scheduler = lr_scheduler(optimizer, config)
    if config.compile:
        model.compile()  # in place, so the state dict keeps its names; compiled at the first step
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    model.mark_forward_method("encode")  # model.encode(x) then runs through the strategy wrapper

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if config.resume:
        fabric.load(config.resume, state)
    run.start(config, state["step"])  # config.json; the metrics up to the resumed step

    stop = StopRequests(device, fabric.all_reduce)  # signals and NaNs, all ranks together
    loop = Bookkeeping(config, state, run, stop, "autoencoder", config.batch_size * world_size * config.accumulate)
    started = time.time()
    for step, micro_batches in accumulated(loader, state["step"], config.accumulate):
        if step >= config.max_steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0  # the mean over the step's examples: each micro-batch's mean, divided by their number
        for i, (images, _) in enumerate(micro_batches):
            with fabric.no_backward_sync(model, enabled=i < config.accumulate - 1):  # gradients sync once, at the last
                micro_loss = F.mse_loss(model(images), images) / config.accumulate
                fabric.backward(micro_loss)
            loss = loss + micro_loss.detach()
        optimizer.step()
        scheduler.step()

        if loop.end_step(step, loss, lambda: {"loss": loss.item()}):
            break
        if loop.checkpoint_due():  # in the background: once written, the Future keeps it
            saving = fabric.save(run.checkpoint, state, background=config.save_in_background)
            run.keep_checkpoint(state["step"], after=saving)
    loop.close()
    fabric.save(run.checkpoint, state)
    run.keep_checkpoint(state["step"])
    if stop.reason:
        return stop.report(run, state["step"])

    model.eval()
    results = evaluate(model, test_set, train_set, device)
    summary = finish(run, config, results, started, state["step"])
    return summary


if __name__ == "__main__":
    cli(main, Config, FabricFlags, prog="python -m autoencoder.train", description=__doc__)
