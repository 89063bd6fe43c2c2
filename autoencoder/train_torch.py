"""Autoencoder: encoder + decoder grouped in one module, one optimizer with a param group each.

    python -m autoencoder.train_torch
    torchrun --nproc-per-node 2 -m autoencoder.train_torch

`sdiff autoencoder/train_torch.py autoencoder/train.py` shows what core replaces.
"""
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from autoencoder.config import Config
from autoencoder.data import CHANNELS, load_splits, make_loader
from autoencoder.model import AutoEncoder
from autoencoder.report import evaluate, finish
from common.bookkeeping import Bookkeeping
from common.config import cli
from common.plain_checkpoint import load_plain, save_plain
from common.rundir import RunDir
from common.steps import accumulated, lr_scheduler
from common.stopping import StopRequests


def main(config: Config) -> dict:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # cuda:LOCAL_RANK, or cuda:0 where each rank sees only its own GPU (CUDA_VISIBLE_DEVICES set per rank)
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and any bare .cuda() then use this rank's GPU, not cuda:0
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:  # the process group is torn down on every way out: finished, stopped, or an error
        return train(config, rank, world_size, device)
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def train(config: Config, rank: int, world_size: int, device: torch.device) -> dict:
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    run = RunDir(config.out, "autoencoder", write=rank == 0, resume=config.resume)

    train_set, test_set = load_splits(config.dataset, config.data_root, config.image_size, config.download)
    loader = make_loader(train_set, config.batch_size, config.seed, config.num_workers, rank, world_size,
                         pin_memory=device.type == "cuda")  # page-locked batches copy to the GPU asynchronously

    model = AutoEncoder(CHANNELS[config.dataset], config.latent, config.image_size, config.width).to(device)
    optimizer = torch.optim.Adam([{"params": model.encoder.parameters(), "lr": config.lr_encoder},
                                  {"params": model.decoder.parameters(), "lr": config.lr_decoder}])
    scheduler = lr_scheduler(optimizer, config)
    if config.compile:
        model.compile()  # in place, so the state dict keeps its names; compiled at the first step
    if world_size > 1:
        model = DistributedDataParallel(model)

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if config.resume:
        load_plain(config.resume, state, device)
    run.start(config, state["step"])  # config.json; the metrics up to the resumed step

    stop = StopRequests(device, dist.all_reduce if world_size > 1 else None)  # signals and NaNs, all ranks together
    loop = Bookkeeping(config, state, run, stop, "autoencoder", config.batch_size * world_size * config.accumulate)
    started = time.time()
    for step, micro_batches in accumulated(loader, state["step"], config.accumulate):
        if step >= config.max_steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0  # the mean over the step's examples: each micro-batch's mean, divided by their number
        for i, (images, _) in enumerate(micro_batches):
            with model.no_sync() if world_size > 1 and i < config.accumulate - 1 else nullcontext():  # sync at the last
                images = images.to(device, non_blocking=True)  # from pinned memory: the copy overlaps the next work
                micro_loss = F.mse_loss(model(images), images) / config.accumulate
                micro_loss.backward()
            loss = loss + micro_loss.detach()
        optimizer.step()
        scheduler.step()

        if loop.end_step(step, loss, lambda: {"loss": loss.item()}):
            break
        if loop.checkpoint_due():
            if rank == 0:
                save_plain(run.checkpoint, state)
            run.keep_checkpoint(state["step"])
    loop.close()
    if rank == 0:
        save_plain(run.checkpoint, state)
    run.keep_checkpoint(state["step"])
    if stop.reason:
        return stop.report(run, state["step"])

    model.eval()
    results = evaluate(getattr(model, "module", model), test_set, train_set, device)  # DDP is not needed here
    summary = finish(run, config, results, started, state["step"])
    return summary


if __name__ == "__main__":
    cli(main, Config, prog="python -m autoencoder.train_torch", description=__doc__)
