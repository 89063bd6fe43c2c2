"""core's seams: a set-up module is an nn.Module to its user (hooks, device, dtype, names), the
submodule guard, and new precisions and strategies added through their registries."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core import Fabric
from core import precision as precisions
from core import strategies
from core.wrappers import FabricModule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def generate(self, x, steps: int = 2):  # a method that calls the module itself, like nanoGPT's
        for _ in range(steps):
            x = torch.cat([x[:, 2:], self(x)], dim=1)
        return x


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_hooks_on_the_set_up_module_fire(precision):
    model = Fabric(accelerator="cpu", precision=precision).setup(Net())
    seen = []
    pre = model.register_forward_pre_hook(lambda module, args: seen.append(("pre", module)))
    post = model.register_forward_hook(lambda module, args, output: seen.append(("post", output.dtype)))
    model(torch.randn(3, 4))
    assert seen == [("pre", model), ("post", torch.float32)]
    pre.remove(), post.remove()
    model(torch.randn(3, 4))
    assert len(seen) == 2


def test_set_up_module_reads_as_the_original():
    original = Net()
    model = Fabric(accelerator="cpu", precision="bf16-true").setup(original)
    assert isinstance(model, nn.Module) and model.module is original
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in original.named_parameters()]
    assert [name for name, _ in model.named_buffers()] == ["calls"]
    assert list(model.state_dict()) == list(original.state_dict())
    assert model.device == torch.device("cpu") and model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == 4 * 8 + 8 + 8 * 2 + 2


def test_marked_method_that_calls_the_module_itself():
    model = Fabric(accelerator="cpu", precision="bf16-mixed").setup(Net())
    model.mark_forward_method("generate")
    x = torch.randn(3, 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model.module.generate(x)
    assert torch.equal(model.generate(x), expected.float())
    assert "forward" not in model.module.__dict__  # the redirection is undone


def guarded(module: nn.Module) -> FabricModule:
    """A module wrapped the way DDP's is (a separate forward module, the guard on), without processes."""
    forward_module = nn.Sequential(module)  # stands in for DistributedDataParallel(module)
    return FabricModule(forward_module, module, precisions.Precision(torch.device("cpu")), guard=True)


def test_guard_refuses_a_child_called_outside_and_allows_the_rest():
    model = guarded(Net())
    x = torch.randn(3, 4)
    for _ in range(3):
        model(x).sum().backward()  # children called inside the wrapper's forward: allowed
    assert len(model.module.body._forward_pre_hooks) == 1  # one hook, registered once
    with pytest.raises(RuntimeError, match="Submodule 'body' of the set-up Net was called outside"):
        model.module.body(x)
    with torch.no_grad():
        model.module.body(x)  # no gradients to synchronise
    model.mark_forward_method("generate")
    model.generate(x).sum().backward()


def test_guard_refuses_an_unmarked_method_that_calls_the_module_itself():
    """A method that calls `self(x)` on a module whose forward uses only its own parameters calls no child:
    the guard on the module itself must catch it, or DDP's gradient sync is skipped without a word."""
    class OwnWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 2))

        def forward(self, x):
            return x @ self.weight

        def generate(self, x):
            return self(x)

    model = guarded(OwnWeight())
    x = torch.randn(3, 4)
    model(x).sum().backward()  # through the wrapper: allowed
    with pytest.raises(RuntimeError, match="The set-up OwnWeight was called outside its distributed wrapper"):
        model.generate(x)
    model.mark_forward_method("generate")
    model.generate(x).sum().backward()


def test_guard_allows_activation_checkpointing_to_recompute_a_child():
    class Checkpointed(Net):
        def forward(self, x):
            return self.head(checkpoint(self.body, x, use_reentrant=False))

    model = guarded(Checkpointed())
    model(torch.randn(3, 4)).sum().backward()  # backward runs body's forward again, outside the wrapper
    assert model.module.body.weight.grad is not None


def test_guard_leaves_with_its_wrapper():
    class WithStep(Net):
        def training_step(self, x):  # routed through the wrapper: its redirection must not keep the wrapper alive
            return self(x).sum()

    original = WithStep()
    model = guarded(original)
    model.mark_forward_method("training_step")
    model.training_step(torch.randn(3, 4))
    del model
    original.body(torch.randn(3, 4))  # a plain module again, without waiting for the garbage collector
    assert not original.body._forward_pre_hooks


def test_attributes_set_on_the_set_up_module_reach_the_original():
    class Scaled(Net):
        scale = 1.0

        def forward(self, x):
            return super().forward(x) * self.scale

    original = Scaled()
    model = Fabric(accelerator="cpu", precision="bf16-mixed").setup(original)
    model.scale = 0.0
    assert original.scale == 0.0 and torch.equal(model(torch.randn(3, 4)), torch.zeros(3, 2))
    model.eval()
    assert not model.training and not original.training
    forward = original.forward = lambda x: torch.zeros(x.shape[0], 2)  # a forward set on the instance
    model.mark_forward_method("generate")
    assert torch.equal(model.generate(torch.ones(3, 4), steps=1)[:, 2:], torch.zeros(3, 2))  # generate used it
    assert original.__dict__["forward"] is forward  # kept through the marked method's redirection


# --- registries ----------------------------------------------------------------------------------
class Float64True(precisions.Precision):
    """A toy mode: the module and float inputs in float64."""
    name, dtype, passthrough = "64-true", torch.float64, False

    def convert_module(self, module):
        return module.double()

    def convert_input(self, data):
        return precisions.cast_floats(data, torch.float64)


def test_a_precision_added_through_the_registry(monkeypatch):
    monkeypatch.setattr(precisions, "PRECISIONS", dict(precisions.PRECISIONS))  # the table is restored after
    precisions.register_precision("toy-64", Float64True)
    fabric = Fabric(accelerator="cpu", precision="toy-64")
    assert type(fabric._precision) is Float64True
    model = fabric.setup(Net())
    assert model.module.body.weight.dtype == torch.float64
    assert model(torch.randn(3, 4)).dtype == torch.float64
    with pytest.raises(TypeError, match="subclass of core.precision.Precision"):
        precisions.register_precision("broken", object)
    with pytest.raises(ValueError, match="Unknown precision '65-true'. Choose one of: 32-true, .*toy-64"):
        Fabric(accelerator="cpu", precision="65-true")
    with pytest.raises(ValueError, match="'toy-64' has no DeepSpeed config"):
        fabric._precision.deepspeed_config()


class StaticLossScale(precisions.Precision):
    """A toy mode that owns a loss scale, as 16-mixed owns its scalers: the loss times 1024 in backward, the
    gradients divided back before the optimizer steps. Fabric only hands it the loss and the optimizer."""
    name, passthrough, scales_loss = "static-scale", False, True

    def scale_loss(self, loss, optimizers=None):
        return loss * 1024

    def optimizer_step(self, optimizer, **kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad /= 1024
        return optimizer.step(**kwargs)


def test_a_precision_that_scales_the_loss_trains_as_plain_sgd(monkeypatch):
    monkeypatch.setattr(precisions, "PRECISIONS", dict(precisions.PRECISIONS))
    precisions.register_precision("static-scale", StaticLossScale)
    fabric = Fabric(accelerator="cpu", precision="static-scale")
    model, plain = Net(), Net()
    plain.load_state_dict(model.state_dict())
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    plain_grads = []
    for net, opt, backward in ((plain, plain_optimizer, torch.Tensor.backward), (model, optimizer, fabric.backward)):
        for step in range(2):
            opt.zero_grad()
            backward(F.mse_loss(net(x), y))
            if net is plain:
                plain_grads.append(plain.head.weight.grad.clone())
            else:  # the scaled loss's gradient, unscaled again by the mode's own optimizer_step
                assert torch.equal(model.module.head.weight.grad, 1024 * plain_grads[step])
            opt.step()
    assert torch.equal(model.module.head.weight, plain.head.weight)  # a power of two: exact


class CountingSteps(strategies.SingleDevice):
    """A toy strategy: the single-device one that counts optimizer steps."""

    def __init__(self, device, precision, start: int = 0):
        super().__init__(device, precision)
        self.steps = start

    def optimizer_step(self, optimizer, module, **kwargs):
        self.steps += 1
        return super().optimizer_step(optimizer, module, **kwargs)


def test_a_strategy_added_through_the_registry(monkeypatch):
    monkeypatch.setitem(strategies.STRATEGIES, "counting", (CountingSteps, {"start": 10}))
    fabric = Fabric(accelerator="cpu", strategy="counting")
    model = Net()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plain = Net()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    for net, opt, backward in ((model, optimizer, fabric.backward), (plain, plain_optimizer, torch.Tensor.backward)):
        for _ in range(2):
            opt.zero_grad()
            backward(F.mse_loss(net(x), y))
            opt.step()
    assert fabric.strategy.steps == 12 and fabric.strategy.name == "counting"
    assert torch.equal(model.module.head.weight, plain.head.weight)
    with pytest.raises(ValueError, match=r"strategy='counting' sets \['start'\] itself"):
        Fabric(accelerator="cpu", strategy="counting", start=3)
    with pytest.raises(TypeError, match="subclass of core.strategies.SingleDevice"):
        strategies.register_strategy("broken", nn.Linear)
    strategies.register_strategy("counting_from_5", CountingSteps, start=5)
    try:
        assert Fabric(accelerator="cpu", strategy="counting_from_5").strategy.steps == 5
    finally:
        del strategies.STRATEGIES["counting_from_5"]


def test_each_rank_finds_its_gpu_also_when_it_sees_only_its_own(monkeypatch):
    """cuda:LOCAL_RANK where a rank sees every GPU of its node; cuda:0 where CUDA_VISIBLE_DEVICES shows each
    rank one GPU (LOCAL_RANK then exceeds the visible devices); more ranks than GPUs is refused, saying what
    to do. (The device count is simulated: this runs on machines without a GPU.)"""
    from core.strategies.ddp import cuda_index
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [cuda_index(rank) for rank in range(4)] == [0, 1, 2, 3]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert [cuda_index(rank) for rank in range(4)] == [0, 0, 0, 0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is 2 but this process sees 2 GPUs .* CUDA_VISIBLE_DEVICES"):
        cuda_index(2)


# --- the optimizer wrapper ------------------------------------------------------------------------
def test_the_optimizer_wrapper_delegates_and_never_holds_stale_state():
    """A set-up optimizer is still an Adam to its user, and every attribute is the original's: after
    load_state_dict (which rebinds the original's `state`), a scheduler's writes, or a user's own attribute,
    the wrapper and the original agree, since the wrapper copies nothing."""
    fabric = Fabric(accelerator="cpu")
    model = Net()
    raw = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, raw)
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.optimizer is raw
    assert set(vars(optimizer)) == {"_optimizer", "_step"}  # nothing of the original's copied
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fabric.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    scheduler.step()
    assert raw.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.05
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    assert optimizer.state is raw.state and optimizer.param_groups is raw.param_groups
    optimizer.note = "mine"  # an attribute a user sets lands on the original
    assert raw.note == "mine" and "note" not in vars(optimizer)
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
