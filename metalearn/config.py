"""MAML's configuration, shared by both variants; defaults are the paper's sinusoid setup, with the outer
learning rate on a cosine schedule from 5e-3 (metalearn/README.md says why)."""
from dataclasses import dataclass

from common.config import RunConfig, flag, usable_cores
from metalearn.data import TASKS


@dataclass
class Config(RunConfig):
    dataset: str = flag("sinusoid", "task family (sinusoid and digits are embedded)", choices=TASKS)
    max_steps: int = flag(20000, "meta-iterations (outer optimizer steps)")
    batch_size: int = flag(25, "tasks per meta-batch, split across processes")
    log_every: int = flag(500, "write metrics every N meta-iterations")
    shots: int = flag(10, "support examples per task (per class for classification): the paper's K")
    queries: int = flag(10, "query examples per task (per class for classification) in training (the paper's K)")
    ways: int = flag(5, "classes per task (classification only): the paper's N")
    hidden: int = flag(40, "units in each hidden layer")
    inner_lr: float = flag(0.01, "inner SGD step size (the paper's alpha); the initial value with --learn-inner-lr")
    inner_steps: int = flag(1, "inner SGD steps per task in training")
    first_order: bool = flag(False, "drop second-order terms (FOMAML)")
    learn_inner_lr: bool = flag(False, "learn a step size per parameter (Meta-SGD)")
    lr: float = flag(5e-3, "outer Adam learning rate (the paper's beta, 1e-3, at a constant rate; here the start "
                           "of --lr-schedule's decay)")
    lr_schedule: str = flag("cosine", "outer learning rate over the run: constant (the paper's), or cosine (a linear "
                                      "warm-up over --warmup-steps, then a cosine decay to 0 at --max-steps)",
                            choices=("constant", "cosine"))
    eval_tasks: int = flag(600, "held-out tasks for the final evaluation")
    eval_queries: int = flag(100, "query points per held-out task (sinusoid) or per class (classification)")
    threads: int = flag(1, "intra-op threads per process (0: torch's default, or core's share with --devices); "
                           "one is as fast for MAML's 40-unit layers, and the figures then do not depend on the cores")

    def needs(self) -> set[str]:
        """What MAML needs of a strategy (core's flags pass it to Fabric, which refuses a strategy that cannot give
        it): the learner reads its weights directly, to make each task's copy of them."""
        return {"weights_outside_forward"}

    def check(self):
        super().check()
        if self.inner_steps < 0 or self.shots < 1 or self.queries < 1:
            raise ValueError("--inner-steps must be >= 0, --shots and --queries >= 1")
        self.check_at_least(1, "ways", "hidden", "eval_tasks", "eval_queries")
        self.check_at_least(0, "inner_lr", "lr", "threads")
        if self.threads > 4 * usable_cores():
            raise ValueError(f"--threads {self.threads}: this process may use {usable_cores()} cores; pass at most "
                             f"{4 * usable_cores()} (0: torch's default)")
        self.check_fits({"--hidden": self.hidden ** 2,  # a hidden layer's weight, a meta-batch, the held-out tasks
                         "--batch-size, --accumulate, --shots and --queries":
                             self.batch_size * self.accumulate * (self.shots + self.queries),
                         "--eval-tasks, --shots and --eval-queries":
                             self.eval_tasks * (self.shots + self.eval_queries)})
