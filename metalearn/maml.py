"""MAML (Finn et al., 2017) on torch.func: inner steps by `grad`, tasks in parallel by `vmap`.

The learner is an nn.Module whose forward returns the meta-loss of a batch of tasks, so it is set up
and synchronised like any other model: its inner loop runs inside forward (torch.func's `grad` is a
function transform, not a backward through the strategy's hooks), and the one outer `backward`
reaches the initial weights (and, for Meta-SGD, the learned step sizes) through every inner update.
Under DDP each process takes its share of the tasks; the all-reduced gradient of the mean meta-loss
is the gradient of the whole meta-batch.
"""
import torch
from torch import nn
from torch.func import functional_call, grad, vmap


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

    def _task_loss(self, params, x, y):
        return self.loss_fn(functional_call(self.model, params, (x,)), y)

    def adapt(self, params: dict, support_x, support_y, steps: int, optimizer: InnerSGD) -> dict:
        """`steps` inner updates of `params` on one task's support set."""
        for _ in range(steps):
            params = optimizer.step(params, grad(self._task_loss)(params, support_x, support_y))
        return params

    def forward(self, support_x, support_y, query_x, query_y):  # -> (T,) query loss of each task
        params = dict(self.model.named_parameters())
        optimizer = self.inner_optimizer()

        def query_loss(sx, sy, qx, qy):  # one task: adapt on its support set, score on its query set
            return self._task_loss(self.adapt(params, sx, sy, self.inner_steps, optimizer), qx, qy)

        return vmap(query_loss)(support_x, support_y, query_x, query_y)

    @torch.no_grad()
    @torch.compiler.disable  # a compiled learner (--compile) runs this eagerly: each step count would recompile
    def evaluate(self, support_x, support_y, query_x, query_y, steps: int):
        """Per-task query outputs and losses after `steps` inner updates (no meta-gradient)."""
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        optimizer = self.inner_optimizer(first_order=True)

        def outputs(sx, sy, qx):
            adapted = self.adapt(params, sx, sy, steps, optimizer)  # grad is a transform: no_grad does not stop it
            return functional_call(self.model, adapted, (qx,))

        predictions = vmap(outputs)(support_x, support_y, query_x)
        losses = vmap(self.loss_fn)(predictions, query_y)
        return predictions, losses
