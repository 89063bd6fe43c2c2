"""Each workload's training step at its default sizes, plain (as its train_torch.py takes it) and through core (as its
train.py does), on one process or under ddp: what a user pays per step, for benchmarks.overhead's workload rows.

Both sides drive their own copies of the same initial weights, on the same batch at every step, with the same
DDP options as the scripts (the GAN's D keeps its BatchNorm buffers local on both). Schedulers, the EMA and
bookkeeping are the same plain code in both scripts and are left out, and so is data loading, where train.py's
set-up loader and its `no_backward_sync(..., enabled=False)` around each micro-batch are core's work too: the ratio
is of the training step alone. The GAN's sides are benchmarks/two_models.py's.
"""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from benchmarks import two_models


def _plain_update(optimizer, backward=lambda loss: loss.backward()):
    def update(loss):
        optimizer.zero_grad(set_to_none=True)
        backward(loss)
        optimizer.step()
    return update


def gan(fabric, ddp: bool) -> dict:
    real, noise = two_models._data()
    generator, discriminator, optimizer_g, optimizer_d = two_models._models()
    if ddp:  # as gan/train_torch.py wraps them: D keeps its BatchNorm buffers local, and runs frozen via .module
        generator = DistributedDataParallel(generator)
        discriminator = DistributedDataParallel(discriminator, broadcast_buffers=False)
    frozen = discriminator.module if ddp else discriminator

    def plain():
        two_models._plain_step(generator, discriminator, lambda x: two_models._frozen_call(frozen, x),
                               _plain_update(optimizer_d), _plain_update(optimizer_g), real, noise)

    g, d, opt_g, opt_d = two_models._models()
    g, opt_g = fabric.setup(g, opt_g)
    d, opt_d = fabric.setup(d, opt_d, **({"ddp": {"broadcast_buffers": False}} if ddp else {}))  # as gan/train.py
    return {"plain": plain, "wrapped": two_models._wrapped_step(fabric, g, d, opt_g, opt_d, real, noise),
            "modules": {"plain": [generator, discriminator], "wrapped": [g, d]}}


def autoencoder(fabric, ddp: bool) -> dict:
    from autoencoder.config import Config
    from autoencoder.model import AutoEncoder

    config = Config()
    images = torch.rand(config.batch_size, 1, config.image_size, config.image_size,
                        generator=torch.Generator().manual_seed(0)) * 2 - 1

    def built():
        torch.manual_seed(0)
        model = AutoEncoder(1, config.latent, config.image_size, config.width)
        return model, torch.optim.Adam([{"params": model.encoder.parameters(), "lr": config.lr_encoder},
                                        {"params": model.decoder.parameters(), "lr": config.lr_decoder}])

    model, optimizer = built()
    model = DistributedDataParallel(model) if ddp else model
    wrapped, wrapped_optimizer = fabric.setup(*built())
    plain, core = _plain_update(optimizer), _plain_update(wrapped_optimizer, fabric.backward)
    return {"plain": lambda: plain(F.mse_loss(model(images), images)),
            "wrapped": lambda: core(F.mse_loss(wrapped(images), images)),
            "modules": {"plain": [model], "wrapped": [wrapped]}}


def metalearn(fabric, ddp: bool) -> dict:
    from metalearn.config import Config
    from metalearn.data import Sinusoid
    from metalearn.maml import MetaLearner
    from metalearn.model import MLP

    config = Config()
    world = fabric.world_size
    batch = Sinusoid().sample(config.batch_size, config.shots, config.queries, torch.Generator().manual_seed(0))
    share = [t.tensor_split(world)[fabric.global_rank] for t in batch]  # each rank its tasks, as the scripts split

    def built():
        torch.manual_seed(0)
        learner = MetaLearner(MLP(1, config.hidden, 1), F.mse_loss, config.inner_lr, config.inner_steps,
                              config.first_order, config.learn_inner_lr)
        return learner, torch.optim.Adam(learner.parameters(), lr=config.lr)

    learner, optimizer = built()
    learner = DistributedDataParallel(learner) if ddp else learner
    wrapped, wrapped_optimizer = fabric.setup(*built())
    plain, core = _plain_update(optimizer), _plain_update(wrapped_optimizer, fabric.backward)
    scale = world / config.batch_size
    return {"plain": lambda: plain(learner(*share).sum() * scale),
            "wrapped": lambda: core(wrapped(*share).sum() * scale),
            "modules": {"plain": [learner], "wrapped": [wrapped]}}


WORKLOADS = {"gan": gan, "autoencoder": autoencoder, "metalearn": metalearn}


def same_work(workload: str, steps: int = 2) -> float:
    """two_models.largest_difference of a workload's sides, in 32-true on one process."""
    from core import Fabric
    return two_models.largest_difference(WORKLOADS[workload](Fabric(accelerator="cpu"), ddp=False), steps)
