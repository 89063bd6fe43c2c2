"""MAML: an inner SGD per task, an outer Adam on the shared initialisation; the meta-batch split across ranks.

    python -m metalearn.train_torch
    torchrun --nproc-per-node 2 -m metalearn.train_torch

`sdiff metalearn/train_torch.py metalearn/train.py` shows what core replaces.
"""
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.bookkeeping import Bookkeeping
from common.config import cli
from common.plain_checkpoint import load_plain, save_plain
from common.rundir import RunDir
from common.steps import lr_scheduler, step_generator
from common.stopping import StopRequests
from metalearn.config import Config
from metalearn.data import make_tasks
from metalearn.maml import MetaLearner
from metalearn.model import MLP
from metalearn.report import evaluate, finish, loss_function


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
    torch.set_num_threads(config.threads or torch.get_num_threads())
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    run = RunDir(config.out, "metalearn", write=rank == 0, resume=config.resume)

    tasks = make_tasks(config.dataset, config.ways, True, config.data_root, config.download)
    test_tasks = make_tasks(config.dataset, config.ways, False, config.data_root, config.download)

    model = MLP(tasks.in_features, config.hidden, tasks.out_features)
    learner = MetaLearner(model, loss_function(config.dataset), config.inner_lr, config.inner_steps,
                          config.first_order, config.learn_inner_lr).to(device)
    optimizer = torch.optim.Adam(learner.parameters(), lr=config.lr)
    scheduler = lr_scheduler(optimizer, config)
    if config.compile:
        learner.compile()  # in place, so the state dict keeps its names; compiled at the first step
    if world_size > 1:
        learner = DistributedDataParallel(learner)

    state = {"learner": learner, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if config.resume:
        load_plain(config.resume, state, device)
    run.start(config, state["step"])  # config.json; the metrics up to the resumed step

    stop = StopRequests(device, dist.all_reduce if world_size > 1 else None)  # signals and NaNs, all ranks together
    loop = Bookkeeping(config, state, run, stop, "metalearn", config.batch_size * config.accumulate)
    started = time.time()
    tasks_per_step = config.batch_size * config.accumulate
    for step in range(state["step"], config.max_steps):
        # every rank draws the whole meta-batch from (seed, step) and keeps its own share of the tasks
        generator = step_generator(config.seed, 0, step)
        meta_batch = tasks.sample(tasks_per_step, config.shots, config.queries, generator)
        share = [t.tensor_split(world_size)[rank].to(device) for t in meta_batch]
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for i, micro_batch in enumerate(zip(*(t.tensor_split(config.accumulate) for t in share))):
            with learner.no_sync() if world_size > 1 and i < config.accumulate - 1 else nullcontext():
                # the sum over these tasks, scaled so that the gradient summed over micro-batches and averaged
                # across ranks is the gradient of the mean over the whole meta-batch, however unevenly it splits
                micro_loss = learner(*micro_batch).sum() * world_size / tasks_per_step
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

    results = evaluate(getattr(learner, "module", learner).evaluate, test_tasks, config, device)
    summary = finish(run, config, results, started, state["step"])
    return summary


if __name__ == "__main__":
    cli(main, Config, prog="python -m metalearn.train_torch", description=__doc__)
