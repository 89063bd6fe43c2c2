"""MAML: an inner SGD per task, an outer Adam on the shared initialisation; the meta-batch split across ranks.

    python -m metalearn.train
    python -m metalearn.train --strategy ddp --devices 2

`sdiff metalearn/train_torch.py metalearn/train.py` shows what core replaces.
"""
import time

import torch

from common.bookkeeping import Bookkeeping
from common.config import cli
from common.rundir import RunDir
from common.steps import lr_scheduler, step_generator
from common.stopping import StopRequests
from core import Fabric
from core.cli import FabricFlags
from metalearn.config import Config
from metalearn.data import make_tasks
from metalearn.maml import MetaLearner
from metalearn.model import MLP
from metalearn.report import evaluate, finish, loss_function


def main(config: Config) -> dict:
    fabric = Fabric(**config.fabric_options())
    fabric.launch()
    rank, world_size, device = fabric.global_rank, fabric.world_size, fabric.device
    torch.set_num_threads(config.threads or torch.get_num_threads())
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    run = RunDir(config.out, "metalearn", write=rank == 0, collectives=fabric, resume=config.resume)

    tasks = make_tasks(config.dataset, config.ways, True, config.data_root, config.download)
    test_tasks = make_tasks(config.dataset, config.ways, False, config.data_root, config.download)

    model = MLP(tasks.in_features, config.hidden, tasks.out_features)
    learner = MetaLearner(model, loss_function(config.dataset), config.inner_lr, config.inner_steps,
                          config.first_order, config.learn_inner_lr)
    optimizer = torch.optim.Adam(learner.parameters(), lr=config.lr)
    scheduler = lr_scheduler(optimizer, config)
    if config.compile:
        learner.compile()  # in place, so the state dict keeps its names; compiled at the first step
    learner, optimizer, scheduler = fabric.setup(learner, optimizer, scheduler=scheduler)
    learner.mark_forward_method("evaluate")  # evaluation also runs through the strategy wrapper

    state = {"learner": learner, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if config.resume:
        fabric.load(config.resume, state)
    run.start(config, state["step"])  # config.json; the metrics up to the resumed step

    stop = StopRequests(device, fabric.all_reduce)  # signals and NaNs, all ranks together
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
            with fabric.no_backward_sync(learner, enabled=i < config.accumulate - 1):
                # the sum over these tasks, scaled so that the gradient summed over micro-batches and averaged
                # across ranks is the gradient of the mean over the whole meta-batch, however unevenly it splits
                micro_loss = learner(*micro_batch).sum() * world_size / tasks_per_step
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

    results = evaluate(learner.evaluate, test_tasks, config, device)
    summary = finish(run, config, results, started, state["step"])
    return summary


if __name__ == "__main__":
    cli(main, Config, FabricFlags, prog="python -m metalearn.train", description=__doc__)
