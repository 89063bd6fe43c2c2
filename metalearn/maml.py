"""MAML (Finn et al., 2017), all tasks of a meta-batch at once.

Each weight w is expanded to one copy per task, w_t (a view, no copy), and the network runs every task
through its own copy in one batched matmul per layer (the model's `forward_tasks`). Since task t's loss
depends only on w_t, one `autograd.grad` of the summed support losses gives every task its own inner
gradient, and w_t' = w_t - lr * dL_t/dw_t. The outer gradient of the query losses flows back through
these updates to w (create_graph), summed over the tasks by the expand.

The learner is an nn.Module whose forward returns the meta-loss of a batch of tasks, so it is set up
and synchronised like any other model: its inner loop runs inside forward (`autograd.grad` with respect
to the per-task copies, which never reaches the strategy's hooks on the weights themselves), and the one
outer `backward` reaches the initial weights (and, for Meta-SGD, the learned step sizes) through every
inner update. Under DDP each process takes its share of the tasks; the all-reduced gradient of the mean
meta-loss is the gradient of the whole meta-batch.
"""
import torch
from torch import nn


class InnerSGD:
    """The differentiable inner optimizer: w' = w - lr * dL/dw, with lr a number (MAML) or a learned
    tensor per parameter (Meta-SGD). `first_order` drops the second-order terms (FOMAML)."""

    def __init__(self, lr, first_order: bool = False):
        self.lr = lr  # float, or dict name -> tensor of the parameter's shape
        self.first_order = first_order

    def step(self, params: dict, grads: dict) -> dict:
        updated = {}
        for name, param in params.items():
            g = grads[name].detach() if self.first_order else grads[name]
            lr = self.lr[name] if isinstance(self.lr, dict) else self.lr
            updated[name] = param - lr * g
        return updated


class MetaLearner(nn.Module):
    """Wraps a model and a loss; forward(support_x, support_y, query_x, query_y) -> each task's query loss.

    Shapes: support_x (T, K, ...), support_y (T, K, ...), query_x (T, Q, ...), query_y (T, Q, ...)
    for T tasks of K support and Q query examples.
    """

    def __init__(self, model: nn.Module, loss_fn, inner_lr: float = 0.01, inner_steps: int = 1,
                 first_order: bool = False, learn_inner_lr: bool = False):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.inner_steps = inner_steps
        self.first_order = first_order
        self.inner_lr = inner_lr
        self.inner_lrs = nn.ParameterDict({name.replace(".", "_"): nn.Parameter(torch.full_like(p, inner_lr))
                                           for name, p in model.named_parameters()}) if learn_inner_lr else None

    def inner_optimizer(self, first_order: bool | None = None) -> InnerSGD:
        lr = self.inner_lr if self.inner_lrs is None else {
            name: self.inner_lrs[name.replace(".", "_")] for name, _ in self.model.named_parameters()}
        return InnerSGD(lr, self.first_order if first_order is None else first_order)

    def task_losses(self, params: dict, x, y):  # -> (T,) each task's mean loss under its own weights
        predictions = self.model.forward_tasks(params, x)
        return self.loss_fn(predictions.flatten(0, 1), y.flatten(0, 1), reduction="none").view(len(x), -1).mean(1)

    def adapt(self, params: dict, support_x, support_y, steps: int, optimizer: InnerSGD) -> dict:
        """`steps` inner updates of each task's weights (`params`: name -> (T, *shape)) on its support set."""
        def loss(weights):  # the sum over tasks: task t's own gradient is d loss / d w_t
            return self.task_losses(weights, support_x, support_y).sum()

        for _ in range(steps):
            if torch.compiler.is_compiling():  # (--compile) torch.func.grad traces into one graph, autograd.grad
                grads = torch.func.grad(loss)(params)  # would break it where compiled code cannot double-backward
            else:  # the same gradient, faster eagerly
                grads = dict(zip(params, torch.autograd.grad(loss(params), list(params.values()),
                                                             create_graph=not optimizer.first_order)))
            params = optimizer.step(params, grads)
        return params

    def per_task(self, tasks: int) -> dict:  # each weight as T views of itself, (T, *shape)
        return {name: p.expand(tasks, *p.shape) for name, p in self.model.named_parameters()}

    def forward(self, support_x, support_y, query_x, query_y):  # -> (T,) query loss of each task
        adapted = self.adapt(self.per_task(len(support_x)), support_x, support_y, self.inner_steps,
                             self.inner_optimizer())
        return self.task_losses(adapted, query_x, query_y)

    @torch.no_grad()
    @torch.compiler.disable  # a compiled learner (--compile) runs this eagerly: each step count would recompile
    def evaluate(self, support_x, support_y, query_x, query_y, steps: int):
        """Per-task query outputs and losses after `steps` inner updates (no meta-gradient)."""
        with torch.enable_grad():  # the inner gradients, of detached weights: nothing reaches the model's
            params = {name: p.detach().requires_grad_() for name, p in self.per_task(len(support_x)).items()}
            adapted = self.adapt(params, support_x, support_y, steps, self.inner_optimizer(first_order=True))
        predictions = self.model.forward_tasks(adapted, query_x)
        losses = self.task_losses(adapted, query_x, query_y)
        return predictions, losses
