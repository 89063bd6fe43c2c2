"""What each step sees, the same in both variants and in a resumed run: its batches, its random draws and its
learning rate are pure functions of (seed, step), so a run resumed at step s goes on exactly as the
uninterrupted run would have, with no RNG or sampler state to save."""
import itertools
import math

import torch


def batches(loader, start_step: int = 0):
    """Yield (step, batch) without end, from `start_step` on. Each epoch's order comes from the
    DistributedSampler's (seed, epoch), so resuming skips to the right batch of the right epoch."""
    if len(loader) == 0:
        raise ValueError("the data loader yields no batch: --batch-size times the number of processes is more "
                         "than the examples of the dataset; lower --batch-size")
    epoch, skip = divmod(start_step, len(loader))
    step = start_step
    for epoch in itertools.count(epoch):
        loader.sampler.set_epoch(epoch)
        for batch in itertools.islice(loader, skip, None):
            yield step, batch
            step += 1
        skip = 0


def accumulated(loader, start_step: int, micro_batches: int):
    """Yield (step, [batch, ...]) without end: `micro_batches` consecutive batches of `batches` per step, so
    that a step of N micro-batches of size B sees exactly the examples of one batch of size N * B."""
    stream = batches(loader, start_step * micro_batches)
    for step in itertools.count(start_step):
        yield step, [batch for _, batch in itertools.islice(stream, micro_batches)]


def step_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A CPU generator for the random draws of one step on one rank, a pure function of (seed, rank, step):
    a resumed run draws exactly the noise the uninterrupted run drew, with no RNG state to save."""
    return torch.Generator().manual_seed(hash((seed, rank, step)) & (2**63 - 1))


def lr_scheduler(optimizer: torch.optim.Optimizer, config) -> torch.optim.lr_scheduler.LambdaLR:
    """--lr-schedule as a scheduler stepped once per optimizer step: a factor 1 (constant), or a linear warm-up
    from 1/(W+1) to 1 over W = --warmup-steps steps, then a cosine from 1 to 0 at --max-steps (cosine)."""
    warmup, total = config.warmup_steps, config.max_steps

    def factor(step: int) -> float:
        if config.lr_schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
