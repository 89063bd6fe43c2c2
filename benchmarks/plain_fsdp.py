"""Plain FSDP2 references of the parity benchmark's fsdp rows: a workload's plain loop with `fully_shard`.

    torchrun --nproc-per-node 2 -m benchmarks.plain_fsdp autoencoder --dataset fake --max-steps 20
    torchrun --nproc-per-node 2 -m benchmarks.plain_fsdp gan --dataset fake --max-steps 20

The plain scripts (`<workload>/train_torch.py`) stay single-device or DDP: FSDP is what the wrapped scripts
gain from `--strategy fsdp`. To time that strategy against plain PyTorch doing the same work, each function
here is the plain script's loop, built from the same model, data, config and bookkeeping, with the lines a
careful FSDP2 user changes: `fully_shard` in place of DDP, the optimizers built after sharding (from the
sharded DTensor parameters), `set_requires_gradient_sync` in place of `no_sync`, `register_fsdp_forward_method`
for a method called outside `forward`, and the checkpoint gathered into full state dicts (collectives on
every rank, written by rank 0) in the layout of the plain scripts' `checkpoints/last.ckpt`. Sharded like
`--strategy fsdp` without `wrap_modules`: each model is one shard group (`fully_shard` on its root), so the
two sides all-gather and reduce-scatter the same tensors. No `--resume`: a reference run starts fresh.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from common.bookkeeping import Bookkeeping
from common.config import cli
from common.ema import EMA
from common.rundir import RunDir
from common.steps import accumulated, batches, lr_scheduler, step_generator
from common.stopping import StopRequests

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors on rank 0's CPU, {} elsewhere


def launch(config):
    """Under torchrun only: rank, world size and device of this process, the process group started."""
    if "RANK" not in os.environ:
        raise ValueError("benchmarks.plain_fsdp runs under torchrun: torchrun --nproc-per-node 2 -m "
                         "benchmarks.plain_fsdp <workload> ...")
    if config.resume:
        raise ValueError("--resume: a plain FSDP reference run starts fresh; drop --resume")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world_size, device


def save(run: RunDir, state: dict, path=None, models: dict | None = None) -> None:
    """The plain scripts' checkpoint layout from sharded models: full state dicts gathered on rank 0 (every
    rank must call it), written there. `models` maps each optimizer's key to its model's."""
    data = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            data[key] = get_model_state_dict(value, options=FULL)
        elif isinstance(value, torch.optim.Optimizer):  # keyed by parameter name, which load_plain also reads
            data[key] = get_optimizer_state_dict(state[models[key]], value, options=FULL)
        elif isinstance(value, EMA):  # the parameters' averages are DTensors, sharded like them; the buffers' not
            data[key] = {name: average.full_tensor().cpu() if isinstance(average, DTensor) else average
                         for name, average in value.state_dict().items()}
        else:
            data[key] = value.state_dict() if hasattr(value, "state_dict") else value
    if run.write:
        path = path or run.checkpoint
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


def autoencoder(config) -> dict:
    """autoencoder/train_torch.py's main with FSDP2 in place of DDP."""
    from autoencoder.data import CHANNELS, load_splits, make_loader
    from autoencoder.model import AutoEncoder
    from autoencoder.report import evaluate, finish

    rank, world_size, device = launch(config)
    torch.manual_seed(config.seed)  # the same initial weights on every rank: each keeps its shard of them
    run = RunDir(config.out, "autoencoder", write=rank == 0)

    train_set, test_set = load_splits(config.dataset, config.data_root, config.image_size, config.download)
    loader = make_loader(train_set, config.batch_size, config.seed, config.num_workers, rank, world_size,
                         pin_memory=device.type == "cuda")

    model = AutoEncoder(CHANNELS[config.dataset], config.latent, config.image_size, config.width).to(device)
    if config.compile:
        model.compile()
    fully_shard(model)  # in place: each parameter is now a DTensor holding this rank's shard
    register_fsdp_forward_method(model, "encode")  # evaluate calls model.encode: it must all-gather too
    # after sharding, from the sharded parameters (an optimizer built before would update the replaced ones)
    optimizer = torch.optim.Adam([{"params": model.encoder.parameters(), "lr": config.lr_encoder},
                                  {"params": model.decoder.parameters(), "lr": config.lr_decoder}])
    scheduler = lr_scheduler(optimizer, config)

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    run.start(config, 0)

    stop = StopRequests(device, dist.all_reduce)
    loop = Bookkeeping(config, state, run, stop, "autoencoder", config.batch_size * world_size * config.accumulate)
    started = time.time()
    for step, micro_batches in accumulated(loader, state["step"], config.accumulate):
        if step >= config.max_steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for i, (images, _) in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == config.accumulate - 1)  # reduce-scatter once, at the last
            images = images.to(device, non_blocking=True)
            micro_loss = F.mse_loss(model(images), images) / config.accumulate
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        optimizer.step()
        scheduler.step()

        if loop.end_step(step, loss, lambda: {"loss": loss.item()}):
            break
        if loop.checkpoint_due():
            save(run, state, models={"optimizer": "model"})
    loop.close()
    save(run, state, models={"optimizer": "model"})
    if stop.reason:
        return stop.report(run, state["step"])

    model.eval()
    results = evaluate(model, test_set, train_set, device)  # every rank: the sharded forward is collective
    summary = finish(run, config, results, started, state["step"])
    dist.destroy_process_group()
    return summary


def gan(config) -> dict:
    """gan/train_torch.py's main with FSDP2 in place of DDP. D's BatchNorm running statistics stay each
    rank's own, as under DDP with broadcast_buffers=False: FSDP2 neither shards nor broadcasts buffers."""
    from gan.augment import Augment
    from gan.data import CHANNELS, load_images, make_loader
    from gan.model import Discriminator, Generator
    from gan.report import evaluate, finish, generate, save_samples

    rank, world_size, device = launch(config)
    torch.manual_seed(config.seed)
    run = RunDir(config.out, "gan", write=rank == 0)

    dataset = load_images(config.dataset, config.data_root, config.image_size, download=config.download)
    loader = make_loader(dataset, config.batch_size, config.seed, config.num_workers, rank, world_size,
                         pin_memory=device.type == "cuda")

    channels = CHANNELS[config.dataset]
    generator = Generator(config.nz, config.ngf, channels, config.image_size, config.generator_native_size()).to(device)
    discriminator = Discriminator(config.ndf, channels, config.image_size).to(device)
    if config.compile:
        generator.compile()
        discriminator.compile()
    fully_shard(generator)  # two independent shard groups, as core shards two set-up modules
    fully_shard(discriminator)
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
    scheduler_g, scheduler_d = lr_scheduler(optimizer_g, config), lr_scheduler(optimizer_d, config)
    ema = EMA(generator, config.ema_decay)  # of this rank's shards
    augment = Augment(config.augment)

    state = {"generator": generator, "discriminator": discriminator, "optimizer_g": optimizer_g,
             "optimizer_d": optimizer_d, "scheduler_g": scheduler_g, "scheduler_d": scheduler_d, "ema": ema,
             "best_fid": float("inf"), "best_step": 0, "step": 0}
    models = {"optimizer_g": "generator", "optimizer_d": "discriminator"}
    run.start(config, 0)

    fixed_noise = torch.randn(64, config.nz, 1, 1, generator=torch.Generator().manual_seed(1)).to(device)
    eval_noise = torch.randn(config.eval_samples, config.nz, 1, 1, generator=torch.Generator().manual_seed(1))
    eval_noise = eval_noise.to(device)
    stop = StopRequests(device, dist.all_reduce)
    loop = Bookkeeping(config, state, run, stop, "gan", config.batch_size * world_size)
    started = time.time()
    for step, (real, _) in batches(loader, state["step"]):
        if step >= config.max_steps:
            break
        real = real.to(device, non_blocking=True)
        draws = step_generator(config.seed, rank, step)  # this step's noise, then its augmentations
        noise = torch.randn(real.size(0), config.nz, 1, 1, generator=draws).to(device)

        # (1) Update D: maximize log D(x) + log(1 - D(G(z)))
        fake = generator(noise)
        logits_real = discriminator(augment(real, draws))  # real and generated images through the same transforms
        logits_fake = discriminator(augment(fake.detach(), draws))
        loss_d = (F.binary_cross_entropy_with_logits(logits_real, torch.ones_like(logits_real))
                  + F.binary_cross_entropy_with_logits(logits_fake, torch.zeros_like(logits_fake)))
        optimizer_d.zero_grad(set_to_none=True)
        loss_d.backward()
        optimizer_d.step()
        scheduler_d.step()

        # (2) Update G: maximize log D(G(z)); D is a fixed function here: its parameters frozen, so its
        # backward leaves them no gradients and reduce-scatters nothing. The sharded parameters are the ones
        # to freeze and thaw: after the forward a root FSDP module holds the gathered ones, which take their
        # requires_grad from the sharded ones at the next all-gather (discriminator.requires_grad_(True)
        # after the forward would leave D frozen for good)
        sharded = list(discriminator.parameters())
        for param in sharded:
            param.requires_grad_(False)
        logits = discriminator(augment(fake, draws))
        for param in sharded:
            param.requires_grad_(True)
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
        if state["step"] % config.sample_every == 0:
            with torch.no_grad():
                save_samples(run, generator(fixed_noise), state["step"])
        if config.eval_every and state["step"] % config.eval_every == 0:  # every rank generates, rank 0 scores
            fid = [evaluate(run, config, generate(generator, eval_noise, ema), state["step"])]
            dist.broadcast_object_list(fid)
            if fid[0] < state["best_fid"]:
                state.update(best_fid=fid[0], best_step=state["step"])
                save(run, state, run.best_checkpoint, models)
        if loop.checkpoint_due():
            save(run, state, models=models)
    loop.close()
    save(run, state, models=models)
    if stop.reason:
        return stop.report(run, state["step"])

    generated, samples = generate(generator, eval_noise, ema), generate(generator, fixed_noise, ema)
    save_samples(run, samples, state["step"])
    raw = generate(generator, eval_noise) if config.ema_decay else None
    best = {"best_step": state["best_step"], "best_fid_classifier": state["best_fid"]} if config.eval_every else None
    summary = finish(run, config, generated, started, state["step"], raw, best)
    dist.destroy_process_group()
    return summary


WORKLOADS = {"autoencoder": autoencoder, "gan": gan}  # metalearn: a 2-layer MLP, the wrapped fsdp row against DDP


if __name__ == "__main__":
    name = sys.argv.pop(1) if len(sys.argv) > 1 else ""
    if name in ("-h", "--help"):
        sys.exit(print(__doc__))
    if name not in WORKLOADS:
        sys.exit(f"python -m benchmarks.plain_fsdp: error: the first argument is the workload: "
                 f"{', '.join(WORKLOADS)} (got {name!r})")
    config_class = __import__(f"{name}.config", fromlist=["Config"]).Config
    cli(WORKLOADS[name], config_class, prog=f"python -m benchmarks.plain_fsdp {name}", description=__doc__)
