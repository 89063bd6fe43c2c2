"""DCGAN in plain PyTorch: one device, or DDP when started by torchrun.

    python -m gan.train_torch
    torchrun --nproc-per-node 2 -m gan.train_torch

`sdiff gan/train_torch.py gan/train.py` shows what core replaces.
"""
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from common.bookkeeping import Bookkeeping
from common.config import cli
from common.ema import EMA
from common.plain_checkpoint import load_plain, save_plain
from common.rundir import RunDir
from common.steps import batches, lr_scheduler, step_generator
from common.stopping import StopRequests
from gan.augment import Augment
from gan.config import Config
from gan.data import CHANNELS, load_images, make_loader
from gan.model import Discriminator, Generator
from gan.report import evaluate, finish, generate, save_samples


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
    run = RunDir(config.out, "gan", write=rank == 0, resume=config.resume)

    dataset = load_images(config.dataset, config.data_root, config.image_size, download=config.download)
    loader = make_loader(dataset, config.batch_size, config.seed, config.num_workers, rank, world_size,
                         pin_memory=device.type == "cuda")  # page-locked batches copy to the GPU asynchronously

    channels = CHANNELS[config.dataset]
    generator = Generator(config.nz, config.ngf, channels, config.image_size, config.generator_native_size()).to(device)
    discriminator = Discriminator(config.ndf, channels, config.image_size).to(device)
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
    scheduler_g, scheduler_d = lr_scheduler(optimizer_g, config), lr_scheduler(optimizer_d, config)
    if config.compile:
        generator.compile()  # in place, so the state dicts keep their names; compiled at the first step
        discriminator.compile()
    if world_size > 1:
        generator = DistributedDataParallel(generator)
        # D runs on real and on fake images before one backward; a buffer broadcast in the second
        # forward would overwrite BatchNorm statistics saved for that backward, so keep buffers local.
        discriminator = DistributedDataParallel(discriminator, broadcast_buffers=False)
    ema = EMA(getattr(generator, "module", generator), config.ema_decay)  # G's average weights
    augment = Augment(config.augment)  # DiffAugment of D's inputs (none: identity, no draws)

    state = {"generator": generator, "discriminator": discriminator, "optimizer_g": optimizer_g,
             "optimizer_d": optimizer_d, "scheduler_g": scheduler_g, "scheduler_d": scheduler_d, "ema": ema,
             "best_fid": float("inf"), "best_step": 0, "step": 0}
    if config.resume:
        load_plain(config.resume, state, device)
    run.start(config, state["step"])  # config.json; the metrics up to the resumed step

    fixed_noise = torch.randn(64, config.nz, 1, 1, generator=torch.Generator().manual_seed(1)).to(device)
    eval_noise = torch.randn(config.eval_samples, config.nz, 1, 1, generator=torch.Generator().manual_seed(1))
    eval_noise = eval_noise.to(device)
    stop = StopRequests(device, dist.all_reduce if world_size > 1 else None)  # signals and NaNs, all ranks together
    loop = Bookkeeping(config, state, run, stop, "gan", config.batch_size * world_size)
    started = time.time()
    for step, (real, _) in batches(loader, state["step"]):
        if step >= config.max_steps:
            break
        real = real.to(device, non_blocking=True)  # from pinned memory: the copy overlaps the next work
        draws = step_generator(config.seed, rank, step)  # this step's noise, then its augmentations
        noise = torch.randn(real.size(0), config.nz, 1, 1, generator=draws).to(device)

        # (1) Update D: maximize log D(x) + log(1 - D(G(z)))
        fake = generator(noise)
        regularise = config.r1_gamma > 0 and step % config.r1_every == 0
        seen = augment(real, draws).requires_grad_(regularise)  # real and generated images through the same transforms
        logits_real = discriminator(seen)
        logits_fake = discriminator(augment(fake.detach(), draws))
        loss_d = (F.binary_cross_entropy_with_logits(logits_real, torch.ones_like(logits_real))
                  + F.binary_cross_entropy_with_logits(logits_fake, torch.zeros_like(logits_fake)))
        if regularise:  # lazy R1: every K steps, K times as strong
            (gradient,) = torch.autograd.grad(logits_real.sum(), seen, create_graph=True)
            loss_d = loss_d + config.r1_every * config.r1_gamma / 2 * gradient.pow(2).sum([1, 2, 3]).mean()
        optimizer_d.zero_grad(set_to_none=True)
        loss_d.backward()
        optimizer_d.step()
        scheduler_d.step()

        # (2) Update G: maximize log D(G(z)); D is a fixed function here: no D gradients, no D all-reduce.
        # D's parameters are frozen, and under DDP D is called through .module, as fabric.frozen does: DDP's
        # forward would only prepare its reducer for a backward that gives D no gradients to reduce.
        frozen_discriminator = discriminator.module if world_size > 1 else discriminator
        frozen_discriminator.requires_grad_(False)
        logits = frozen_discriminator(augment(fake, draws))
        frozen_discriminator.requires_grad_(True)
        loss_g = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
        optimizer_g.zero_grad(set_to_none=True)
        loss_g.backward()
        optimizer_g.step()
        scheduler_g.step()
        ema.update()

        if loop.end_step(step, loss_d + loss_g, lambda: {"loss_d": loss_d.item(), "loss_g": loss_g.item(),
                                                         "d_real": torch.sigmoid(logits_real).mean().item(),
                                                         "d_fake": torch.sigmoid(logits_fake).mean().item()}):
            break
        if config.sample_every and state["step"] % config.sample_every == 0:  # in eval mode: BatchNorm untouched
            save_samples(run, generate(generator, fixed_noise), state["step"])
        if config.eval_every and state["step"] % config.eval_every == 0:  # every rank generates, rank 0 scores
            fid = [evaluate(run, config, generate(generator, eval_noise, ema), state["step"])]
            if world_size > 1:
                dist.broadcast_object_list(fid)
            if fid[0] < state["best_fid"]:  # rank 0's score: every rank takes the same decision
                state.update(best_fid=fid[0], best_step=state["step"])
                if rank == 0:
                    save_plain(run.best_checkpoint, state)
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

    generated, samples = generate(generator, eval_noise, ema), generate(generator, fixed_noise, ema)
    save_samples(run, samples, state["step"])
    raw = generate(generator, eval_noise) if config.ema_decay else None  # scored beside the average as raw_*
    best = {"best_step": state["best_step"], "best_fid_classifier": state["best_fid"]} if config.eval_every else None
    summary = finish(run, config, generated, started, state["step"], raw, best)
    return summary


if __name__ == "__main__":
    cli(main, Config, prog="python -m gan.train_torch", description=__doc__)
