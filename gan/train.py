"""DCGAN through core: the same loop as train_torch.py, on any strategy and precision.

    python -m gan.train                                   # embedded digits, one CPU process
    python -m gan.train --strategy ddp --devices 2        # also fsdp, deepspeed_stage_2, deepspeed_stage_3
    python -m gan.train --precision bf16-mixed

`sdiff gan/train_torch.py gan/train.py` shows what core replaces.
"""
import time

import torch
import torch.nn.functional as F

from common.bookkeeping import Bookkeeping
from common.config import cli
from common.ema import EMA
from common.rundir import RunDir
from common.steps import batches, lr_scheduler, step_generator
from common.stopping import StopRequests
from core import Fabric
from core.cli import FabricFlags
from gan.augment import Augment
from gan.config import Config
from gan.data import CHANNELS, load_images, make_loader
from gan.model import Discriminator, Generator
from gan.report import evaluate, finish, generate, save_samples


def main(config: Config) -> dict:
    fabric = Fabric(**config.fabric_options())
    fabric.launch()
    rank, world_size, device = fabric.global_rank, fabric.world_size, fabric.device
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    run = RunDir(config.out, "gan", write=rank == 0, collectives=fabric, resume=config.resume)

    dataset = load_images(config.dataset, config.data_root, config.image_size, download=config.download)
    loader = make_loader(dataset, config.batch_size, config.seed, config.num_workers, rank, world_size,
                         pin_memory=device.type == "cuda")  # page-locked batches copy to the GPU asynchronously
    loader = fabric.setup_dataloaders(loader)

    channels = CHANNELS[config.dataset]
    generator = Generator(config.nz, config.ngf, channels, config.image_size, config.generator_native_size())
    discriminator = Discriminator(config.ndf, channels, config.image_size)
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
    scheduler_g, scheduler_d = lr_scheduler(optimizer_g, config), lr_scheduler(optimizer_d, config)
    if config.compile:
        generator.compile()  # in place, so the state dicts keep their names; compiled at the first step
        discriminator.compile()
    generator, optimizer_g, scheduler_g = fabric.setup(generator, optimizer_g, scheduler=scheduler_g)
    # D runs on real and on fake images before one backward; a buffer broadcast in the second
    # forward would overwrite BatchNorm statistics saved for that backward, so keep buffers local.
    discriminator, optimizer_d, scheduler_d = fabric.setup(discriminator, optimizer_d, scheduler=scheduler_d,
                                                           ddp={"broadcast_buffers": False})
    ema = EMA(generator, config.ema_decay)  # G's average weights, on each rank's own share of them
    augment = Augment(config.augment)  # DiffAugment of D's inputs (none: identity, no draws)

    state = {"generator": generator, "discriminator": discriminator, "optimizer_g": optimizer_g,
             "optimizer_d": optimizer_d, "scheduler_g": scheduler_g, "scheduler_d": scheduler_d, "ema": ema,
             "best_fid": float("inf"), "best_step": 0, "step": 0}
    if config.resume:
        fabric.load(config.resume, state)
    run.start(config, state["step"])  # config.json; the metrics up to the resumed step

    fixed_noise = torch.randn(64, config.nz, 1, 1, generator=torch.Generator().manual_seed(1)).to(device)
    eval_noise = torch.randn(config.eval_samples, config.nz, 1, 1, generator=torch.Generator().manual_seed(1))
    eval_noise = eval_noise.to(device)
    stop = StopRequests(device, fabric.all_reduce)  # signals and NaNs, all ranks together
    loop = Bookkeeping(config, state, run, stop, "gan", config.batch_size * world_size)
    started = time.time()
    for step, (real, _) in batches(loader, state["step"]):
        if step >= config.max_steps:
            break
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
            (gradient,) = fabric.grad(logits_real.sum(), seen)
            loss_d = loss_d + config.r1_every * config.r1_gamma / 2 * gradient.pow(2).sum([1, 2, 3]).mean()
        optimizer_d.zero_grad(set_to_none=True)
        fabric.backward(loss_d)
        optimizer_d.step()
        scheduler_d.step()

        # (2) Update G: maximize log D(G(z)); D is a fixed function here: no D gradients, no D all-reduce
        with fabric.frozen(discriminator):
            logits = discriminator(augment(fake, draws))
        loss_g = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
        optimizer_g.zero_grad(set_to_none=True)
        fabric.backward(loss_g)
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
            fid = fabric.broadcast(evaluate(run, config, generate(generator, eval_noise, ema), state["step"]))
            if fid < state["best_fid"]:  # rank 0's score: every rank takes the same decision
                state.update(best_fid=fid, best_step=state["step"])
                fabric.save(run.best_checkpoint, state)
        if loop.checkpoint_due():  # in the background: once written, the Future keeps it
            saving = fabric.save(run.checkpoint, state, background=config.save_in_background)
            run.keep_checkpoint(state["step"], after=saving)
    loop.close()
    fabric.save(run.checkpoint, state)
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
    cli(main, Config, FabricFlags, prog="python -m gan.train", description=__doc__)
