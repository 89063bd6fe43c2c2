"""The path where core does the most work per step: the GAN's two models and two optimizers (gan/model.py at the
default sizes of `python -m gan.train`: nz 64, ngf 32, ndf 32, 32 px, the generator drawn at 8 px, batch 64,
Adam), one training step of each model as gan/train.py and gan/train_torch.py take it, wrapped against plain
code that does the same work:

- 16-mixed: on CPU, core's 16-mixed is `torch.autocast("cpu", dtype=torch.float16)` around each set-up
  module's forward, its outputs cast back to float32, and one `torch.amp.GradScaler("cpu")` for both
  optimizers, updated after each model's step (core/precision/base.py): the plain side writes out exactly that,
  torch's recipe for several models.
- deepspeed_stage_2 (32-true, one process): core makes one engine per model, and `fabric.backward` walks the
  graph to find the engine; the plain side calls `deepspeed.initialize` twice with the config core builds
  (checked equal) and steps the engines itself.

Both sides drive their own copies of the models from the same initial weights, on the same batch and noise at
every step. Scheduler steps, the EMA and data loading are the same plain code in both scripts and are left out,
so the ratio is of the training step alone (a larger share for the wrapper than in a whole run).
"""
import torch
import torch.nn.functional as F

from gan.config import Config
from gan.model import Discriminator, Generator

ROWS = ("gan 16-mixed", "gan deepspeed_stage_2")


def _models():
    config = Config()
    torch.manual_seed(0)
    generator = Generator(config.nz, config.ngf, 1, config.image_size, config.generator_native_size())
    discriminator = Discriminator(config.ndf, 1, config.image_size)
    optimizers = [torch.optim.Adam(m.parameters(), lr=config.lr, betas=(config.beta1, 0.999))
                  for m in (generator, discriminator)]
    return generator, discriminator, *optimizers


def _data():
    config, draws = Config(), torch.Generator().manual_seed(0)
    real = torch.rand(config.batch_size, 1, config.image_size, config.image_size, generator=draws) * 2 - 1
    return real, torch.randn(config.batch_size, config.nz, 1, 1, generator=draws)


def _losses(logits_real, logits_fake):
    return (F.binary_cross_entropy_with_logits(logits_real, torch.ones_like(logits_real))
            + F.binary_cross_entropy_with_logits(logits_fake, torch.zeros_like(logits_fake)))


def _wrapped_step(fabric, generator, discriminator, optimizer_g, optimizer_d, real, noise):
    """gan/train.py's step (no augmentation, no R1)."""
    def step():
        fake = generator(noise)
        loss_d = _losses(discriminator(real), discriminator(fake.detach()))
        optimizer_d.zero_grad(set_to_none=True)
        fabric.backward(loss_d)
        optimizer_d.step()
        with fabric.frozen(discriminator):
            logits = discriminator(fake)
        loss_g = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))
        optimizer_g.zero_grad(set_to_none=True)
        fabric.backward(loss_g)
        optimizer_g.step()
    return step


def _frozen_call(module, x, call=lambda module, x: module(x)):
    """D as a fixed function for G's step, as gan/train_torch.py (and fabric.frozen) call it."""
    module.requires_grad_(False)
    try:
        return call(module, x)
    finally:
        module.requires_grad_(True)


def _plain_step(generator, discriminator, frozen_discriminator, update_d, update_g, real, noise):
    """gan/train_torch.py's step (no augmentation, no R1), each call and update as the plain side writes it."""
    fake = generator(noise)
    update_d(_losses(discriminator(real), discriminator(fake.detach())))
    logits = frozen_discriminator(fake)
    update_g(F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)))


def _sides(fabric, plain, generator, discriminator, real, noise) -> dict:
    """The plain step beside the same step through `fabric`, on a fresh pair of the same models."""
    g, d, opt_g, opt_d = _models()
    g, opt_g = fabric.setup(g, opt_g)
    d, opt_d = fabric.setup(d, opt_d)
    return {"plain": plain, "wrapped": _wrapped_step(fabric, g, d, opt_g, opt_d, real, noise), "fabric": fabric,
            "loss": lambda: _losses(d(real), d(g(noise).detach())),
            "modules": {"plain": [generator, discriminator], "wrapped": [g.module, d.module]}}


def sixteen_mixed() -> dict:
    """{"plain", "wrapped"}: one GAN step each, in core's 16-mixed on CPU and written out in plain."""
    from core import Fabric

    real, noise = _data()
    generator, discriminator, optimizer_g, optimizer_d = _models()
    scaler = torch.amp.GradScaler("cpu")

    def autocast(module, x):  # what core's 16-mixed does around a set-up module's forward
        with torch.autocast("cpu", dtype=torch.float16):
            out = module(x)
        return out.float()

    def update(optimizer):
        def through_scaler(loss):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return through_scaler

    def plain():
        _plain_step(lambda x: autocast(generator, x), lambda x: autocast(discriminator, x),
                    lambda x: _frozen_call(discriminator, x, autocast), update(optimizer_d), update(optimizer_g),
                    real, noise)

    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    return _sides(fabric, plain, generator, discriminator, real, noise)


# the config core's deepspeed_stage_2 builds for a 32-true run (core/deepspeed.py DeepSpeed.config), written out
PLAIN_DEEPSPEED_CONFIG = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
                          "zero_force_ds_cpu_optimizer": False, "train_micro_batch_size_per_gpu": 1,
                          "gradient_accumulation_steps": 1, "managed_gradient_accumulation": False,
                          "zero_allow_untested_optimizer": True, "steps_per_print": 2**31}


def deepspeed_stage_2() -> dict:
    """{"plain", "wrapped"}: one GAN step each, core's two ZeRO-2 engines against two made by deepspeed.initialize
    in the same process (core's launch starts the one-process gloo group both use)."""
    import deepspeed

    from core import Fabric

    fabric = Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=1)
    fabric.launch()
    if fabric.strategy.config() != PLAIN_DEEPSPEED_CONFIG:
        raise RuntimeError(f"core's DeepSpeed config changed: {fabric.strategy.config()}; update "
                           f"PLAIN_DEEPSPEED_CONFIG so the plain side runs the same engines")
    real, noise = _data()
    generator, discriminator, optimizer_g, optimizer_d = _models()
    engine_g, *_ = deepspeed.initialize(model=generator, optimizer=optimizer_g, config=PLAIN_DEEPSPEED_CONFIG,
                                        dist_init_required=False)
    engine_d, *_ = deepspeed.initialize(model=discriminator, optimizer=optimizer_d, config=PLAIN_DEEPSPEED_CONFIG,
                                        dist_init_required=False)

    def update(engine):
        def through_engine(loss):
            engine.optimizer.zero_grad(set_to_none=True)
            engine.backward(loss)
            engine.step()
        return through_engine

    def plain():
        _plain_step(engine_g, engine_d, lambda x: _frozen_call(engine_d.module, x), update(engine_d),
                    update(engine_g), real, noise)

    return _sides(fabric, plain, generator, discriminator, real, noise)


SIDES = {"gan 16-mixed": sixteen_mixed, "gan deepspeed_stage_2": deepspeed_stage_2}


def same_work(path: str, steps: int = 3) -> float:
    return largest_difference(SIDES[path](), steps)


def largest_difference(built: dict, steps: int) -> float:
    """The largest difference of any weight or buffer between the plain and the wrapped models of `built` after
    `steps` steps of each: 0 when both sides do the same arithmetic."""
    for _ in range(steps):
        built["plain"]()
        built["wrapped"]()
    pairs = zip(*(built["modules"][side] for side in ("plain", "wrapped")))
    return max((a - b).abs().max().item() for plain, wrapped in pairs
               for a, b in zip(plain.state_dict().values(), wrapped.state_dict().values()) if a.is_floating_point())


def graph_walk_us(built: dict, repeats: int = 200) -> float:
    """What finding the owner of D's loss in its autograd graph (core/wrappers.py module_of_loss, as
    DeepSpeed's backward calls it) takes, in microseconds: median of `repeats`, on a real loss of the step."""
    import statistics
    import time

    from core.wrappers import module_of_loss
    loss, modules = built["loss"](), built["fabric"]._modules
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        module_of_loss(loss, modules)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)
