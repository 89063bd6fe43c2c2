"""MAML: an inner SGD per task, an outer Adam on the shared initialisation; the meta-batch split across ranks.

    python -m metalearn.train
    python -m metalearn.train --strategy ddp --devices 2

`sdiff metalearn/train_torch.py metalearn/train.py` shows what core replaces.
"""
import time

import torch

from common.config import cli
from common.run import (Bookkeeping, RunDir, StopRequests, check_resume_config, resume_path, step_generator,
                        write_config)
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
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    run = RunDir(config.out or config.resume, "metalearn", write=rank == 0, broadcast=fabric.broadcast)

    tasks = make_tasks(config.dataset, config.ways, True, config.data_root, config.download)
    test_tasks = make_tasks(config.dataset, config.ways, False, config.data_root, config.download)

    model = MLP(tasks.in_features, config.hidden, tasks.out_features)
    learner = MetaLearner(model, loss_function(config.dataset), config.inner_lr, config.inner_steps,
                          config.first_order, config.learn_inner_lr)
    optimizer = torch.optim.Adam(learner.parameters(), lr=config.lr)
    learner, optimizer = fabric.setup(learner, optimizer)
    learner.mark_forward_method("evaluate")  # evaluation also runs through the strategy wrapper

    state = {"learner": learner, "optimizer": optimizer, "step": 0}
    if config.resume:
        check_resume_config(resume_path(config.resume), config)
        fabric.load(resume_path(config.resume), state)
        run.truncate_metrics(state["step"])
    write_config(run, config)

    stop = StopRequests(device, fabric.all_reduce)  # signals and NaNs, all ranks together
    loop = Bookkeeping(config, state, run, stop, "metalearn", config.loggers(run.path, state["step"]))
    started = time.time()
    for step in range(state["step"], config.max_steps):
        # every rank draws the whole meta-batch from (seed, step) and keeps its own share of the tasks
        generator = step_generator(config.seed, 0, step)
        meta_batch = tasks.sample(config.batch_size, config.shots, config.queries, generator)
        support_x, support_y, query_x, query_y = (t.tensor_split(world_size)[rank].to(device)
                                                  for t in meta_batch)
        # the sum over this rank's tasks, scaled so that the gradient averaged across ranks is the
        # gradient of the mean over the whole meta-batch, however unevenly it splits
        loss = learner(support_x, support_y, query_x, query_y).sum() * world_size / config.batch_size
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss)
        optimizer.step()

        if loop.end_step(step, loss, lambda: {"loss": loss.item()}):
            break
        if loop.checkpoint_due():
            fabric.save(run.checkpoint, state)
    loop.close()
    fabric.save(run.checkpoint, state)
    if stop.reason:
        return stop.report(run, state["step"])

    results = evaluate(learner.evaluate, test_tasks, config, device)
    summary = finish(run, config, results, started, state["step"])
    return summary


if __name__ == "__main__":
    cli(main, Config, FabricFlags, prog="python -m metalearn.train", description=__doc__)
