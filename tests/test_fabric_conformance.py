"""Behaviours of Lightning Fabric's public API that a ported script relies on (issue 29), each written from
Lightning's documentation and run against core and, where lightning is installed, against Lightning with the
same assertion. Where core differs on purpose, docs/core.md's "Coming from Lightning Fabric" says why."""
import argparse
import importlib.util
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import core
import core.compat

IMPLEMENTATIONS = ["core", pytest.param("lightning", marks=pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning is not installed (the bench extra)"))]


@pytest.fixture(params=IMPLEMENTATIONS)
def Fabric(request):
    if request.param == "core":
        return core.compat.Fabric
    import lightning
    return lightning.Fabric


class OnlyIter(DataLoader):
    """A subclass with DataLoader's own constructor."""

    def __iter__(self):
        return (batch + 1 for batch in super().__iter__())


def _only_iter_batches(fabric):
    return [batch.tolist() for batch in fabric.setup_dataloaders(OnlyIter(torch.arange(6), batch_size=2))]


@pytest.mark.multiprocess
def test_a_dataloader_subclass_without_its_own_init_is_sharded_too(Fabric):
    assert Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(_only_iter_batches) == [[1, 3], [5]]


class Scaled(DataLoader):
    """A DataLoader subclass with an argument of its own and its own __iter__."""

    def __init__(self, dataset, scale, **kwargs):
        super().__init__(dataset, **kwargs)
        self.scale = scale

    def __iter__(self):
        for batch in super().__iter__():
            yield batch * self.scale


def _scaled_batches(fabric):
    loader = fabric.setup_dataloaders(Scaled(torch.arange(6), 100, batch_size=2))
    return [batch.tolist() for batch in loader]


@pytest.mark.multiprocess
def test_a_dataloader_subclass_keeps_its_class_and_arguments_when_sharded(Fabric):
    batches = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(_scaled_batches)
    assert batches == [[0, 200], [400]]  # rank 0's share (0, 2, 4), scaled by the subclass


def test_clip_gradients_raises_on_a_non_finite_norm_unless_told_not_to(Fabric):
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup_module(nn.Linear(2, 1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())
    with pytest.raises(RuntimeError, match="non-finite|nonfinite|is inf|is nan|cannot be clipped"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
    assert not torch.isfinite(norm)


class MakesATensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.dtype_inside = None

    def forward(self, x):
        self.dtype_inside = torch.get_default_dtype()
        return self.linear(x) + torch.ones(2)  # created in forward: in the default dtype


@pytest.mark.parametrize("precision, dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16),
                                              ("64-true", torch.float64)])
def test_true_precisions_set_the_default_dtype_inside_and_return_float32(Fabric, precision, dtype):
    fabric = Fabric(accelerator="cpu", precision=precision)
    with fabric.init_module():
        module = MakesATensor()
    assert module.linear.weight.dtype == dtype
    with fabric.init_tensor():
        assert torch.ones(1).dtype == dtype
    output = fabric.setup(module)(torch.ones(3, 2))
    assert module.dtype_inside == dtype
    assert output.dtype == torch.float32 and torch.get_default_dtype() == torch.float32


def test_seed_everything_seeds_workers_by_default_takes_a_whole_float_and_sets_no_hash_seed(Fabric, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert Fabric.seed_everything(42.0) == 42
    assert os.environ["PL_SEED_WORKERS"] == "1" and "PYTHONHASHSEED" not in os.environ


def test_deepspeed_leaves_no_accelerator_variable_behind(Fabric, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=1)
    assert "DS_ACCELERATOR" not in os.environ


def test_a_checkpoint_opens_with_torch_load_by_the_users_own_keys(Fabric, tmp_path):
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup_module(nn.Linear(3, 2))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.ones(1, 3)).sum())
    optimizer.step()
    fabric.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    saved = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert saved["step"] == 3 and torch.equal(saved["model"]["weight"], model.weight)
    plain = torch.optim.Adam(nn.Linear(3, 2).parameters())
    plain.load_state_dict(saved["optimizer"])  # torch's own layout
    assert torch.equal(plain.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_checkpoints_move_between_core_and_lightning(tmp_path):
    import lightning

    for writer, reader in ((core.compat.Fabric, lightning.Fabric), (lightning.Fabric, core.compat.Fabric)):
        torch.manual_seed(0)
        source = writer(accelerator="cpu")
        model = source.setup_module(nn.Linear(3, 2))
        optimizer = source.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        source.backward(model(torch.ones(1, 3)).sum())
        optimizer.step()
        source.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer, "step": 7})
        target = reader(accelerator="cpu")
        loaded = target.setup_module(nn.Linear(3, 2))
        loaded_optimizer = target.setup_optimizers(torch.optim.SGD(loaded.parameters(), lr=0.1, momentum=0.9))
        state = {"model": loaded, "optimizer": loaded_optimizer, "step": 0}
        target.load(tmp_path / "c.ckpt", state)
        assert state["step"] == 7 and torch.equal(loaded.weight, model.weight)
        assert torch.equal(loaded_optimizer.state_dict()["state"][0]["momentum_buffer"],
                           optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_load_takes_weights_only_false_for_a_trusted_file_and_save_takes_a_filter(Fabric, tmp_path):
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(3, 2))
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=0.1)}, tmp_path / "namespace.ckpt")
    rest = fabric.load(tmp_path / "namespace.ckpt", {"model": model}, weights_only=False)
    assert rest["args"].lr == 0.1
    fabric.save(tmp_path / "filtered.ckpt", {"model": model}, filter={"model": lambda name, value: name == "bias"})
    assert list(torch.load(tmp_path / "filtered.ckpt", weights_only=True)["model"]) == ["bias"]


def test_the_same_raw_module_and_optimizer_set_up_twice(Fabric):
    fabric = Fabric(accelerator="cpu")
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    first, _ = fabric.setup(module, optimizer)
    second, _ = fabric.setup(module, optimizer)
    assert second.module is module and first.module is module


class Recorder:
    def __init__(self):
        self.calls = []

    def on_after_setup(self, fabric, module):
        self.calls.append(("setup", type(module.module).__name__))

    def on_after_optimizer_step(self, strategy, optimizer):
        self.calls.append(("step", type(optimizer).__name__))


def test_callbacks_hear_of_setup_and_of_each_optimizer_step(Fabric):
    recorder = Recorder()
    fabric = Fabric(accelerator="cpu", callbacks=[recorder])
    module = nn.Linear(2, 1)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    fabric.setup_module(nn.Linear(2, 1))  # setup_module calls no hook
    fabric.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    assert recorder.calls == [("setup", "Linear"), ("step", "SGD")]


def test_smaller_api_items(Fabric):
    fabric = Fabric(accelerator="cpu")
    fabric.barrier("named")
    assert "cpu" in repr(fabric.accelerator).lower()


class Unreadable:
    """A callable whose signature inspect cannot read (as some builtins and C extensions)."""

    __signature__ = "unreadable"

    def __call__(self, *args, **kwargs):
        self.got = (args, kwargs)


class WithUnreadableHook:
    def __init__(self):
        self.on_hook = Unreadable()


def test_a_callback_whose_signature_cannot_be_read_gets_every_argument(Fabric):
    callback = WithUnreadableHook()
    Fabric(accelerator="cpu", callbacks=[callback]).call("on_hook", 1, flag=True)
    assert callback.on_hook.got == ((1,), {"flag": True})


@pytest.mark.parametrize("name", ["ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true", "dp"])
def test_lightnings_strategy_names_are_known(Fabric, name):
    fabric = Fabric(accelerator="cpu", strategy=name, devices=1 if name == "dp" else 2)
    assert fabric.world_size == (1 if name == "dp" else 2)


def test_lightnings_strategy_names_mean_what_they_say():
    strategy = lambda name, devices=2: core.compat.Fabric(accelerator="cpu", strategy=name, devices=devices).strategy  # noqa
    assert strategy("ddp_fork").start_method == strategy("ddp_notebook").start_method == "fork"
    assert strategy("ddp_spawn").start_method == "spawn"
    assert strategy("ddp_find_unused_parameters_true").options == {"find_unused_parameters": True}
    assert isinstance(strategy("dp", 1), core.compat.dp.DataParallel)


def _rank_and_world(fabric):
    return fabric.global_rank, fabric.world_size


@pytest.mark.multiprocess
def test_ddp_fork_starts_its_processes_by_fork():
    assert core.compat.Fabric(accelerator="cpu", strategy="ddp_fork", devices=2).launch(_rank_and_world) == (0, 2)


def _setup_a_lightning_module(fabric):
    import lightning

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def forward(self, x):
            self.log("seen", x.sum())
            return self.layer(x)

    module = Module()
    fabric.setup(module)(torch.ones(1, 2))
    return module


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_a_lightning_module_knows_its_fabric_and_logs_through_it(Fabric):
    class Logger:
        def __init__(self):
            self.records = []

        def log_metrics(self, metrics, step=None):
            self.records.append(metrics)

    logger = Logger()
    fabric = Fabric(accelerator="cpu", loggers=[logger])
    module = _setup_a_lightning_module(fabric)
    assert module.fabric is fabric and module.logger is logger
    assert [{k: float(v) for k, v in r.items()} for r in logger.records] == [{"seen": 2.0}]


# --- one step off the workloads' path (issue 40): each item a ported script met, same on core and Lightning ---
class Generates(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x):
        return self.linear(x)

    def generate(self, x):
        return 2 * self(x)


def test_mark_forward_method_takes_the_method_itself(Fabric):
    model = Fabric(accelerator="cpu").setup(Generates())
    model.mark_forward_method(model.generate)  # the first form Lightning's docs show
    assert model.generate(torch.ones(1, 2)).shape == (1, 2)


class NoArgumentZeroGrad(torch.optim.SGD):
    def zero_grad(self):  # an optimizer whose zero_grad takes nothing (some third-party ones)
        super().zero_grad(set_to_none=True)


def test_zero_grad_passes_only_what_it_is_given(Fabric):
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(2, 1)
    model, optimizer = fabric.setup(model, NoArgumentZeroGrad(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(1, 2)).sum())
    optimizer.zero_grad()
    assert model.weight.grad is None


def test_a_set_up_loader_copies_and_pickles(Fabric):
    import copy
    import pickle
    loader = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(torch.arange(4), batch_size=2))
    for clone in (copy.copy(loader), pickle.loads(pickle.dumps(loader))):
        assert [b.tolist() for b in clone] == [[0, 1], [2, 3]]


class RecordingLogger:
    """A logger with Lightning's signature, keyword arguments only past metrics."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((metrics, step))


def test_log_dict_gives_numbers_by_keyword_and_refuses_a_tensor_of_several_elements(Fabric):
    logger = RecordingLogger()
    fabric = Fabric(accelerator="cpu", loggers=logger)
    fabric.log_dict({"loss": torch.tensor(0.5)}, step=3)
    assert logger.rows == [({"loss": 0.5}, 3)]
    with pytest.raises(ValueError):
        fabric.log("weights", torch.ones(3))


@pytest.mark.parametrize("seed", [np.int64(7), "7", torch.tensor(7)])
def test_seed_everything_takes_what_int_takes(Fabric, seed, monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert Fabric.seed_everything(seed) == 7


def test_launch_refuses_a_function_it_cannot_call_before_starting_anything(Fabric):
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(TypeError):
        fabric.launch(None)
    with pytest.raises(TypeError):
        fabric.launch(lambda: None)  # takes no Fabric


def test_launch_takes_its_function_by_keyword_and_refuses_keywords_without_one(Fabric):
    """`launch(function=train)` is Lightning's keyword; keywords with no function to take them are a TypeError, not
    a launch that runs nothing."""
    assert Fabric(accelerator="cpu").launch(function=lambda fabric, x: x + 1, x=1) == 2
    with pytest.raises(TypeError):
        Fabric(accelerator="cpu").launch(fn=lambda fabric: 1)


def test_an_optimizer_over_a_free_parameter_is_refused_with_the_fix():
    """A difference from Lightning, listed in docs/core.md: Lightning trains a free parameter (and under DDP lets
    its ranks drift apart); core refuses before the first step and says to register it on the model."""
    fabric = core.compat.Fabric(accelerator="cpu")
    model, log_alpha = nn.Linear(2, 1), nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"register a free nn.Parameter on the model before setup"):
        fabric.setup(model, torch.optim.Adam([*model.parameters(), log_alpha]))
    model.log_alpha = log_alpha  # the fix the message gives
    fabric.setup(model, torch.optim.Adam(model.parameters()))


@pytest.mark.parametrize("seed, variable", [(2**32, None), (-1, None), ("abc", None), (None, "invalid"),
                                            (None, str(2**40)), (None, "-3")])
def test_seed_everything_refuses_a_seed_out_of_range_or_not_a_number(Fabric, seed, variable, monkeypatch):
    """Out of [0, 2**32), or a string (passed, or in PL_GLOBAL_SEED) that is not a number: a ValueError, before
    anything is seeded. The messages are each implementation's own."""
    if variable is None:
        monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    else:
        monkeypatch.setenv("PL_GLOBAL_SEED", variable)
    with pytest.raises(ValueError):
        Fabric.seed_everything(seed)


def test_seed_everything_reads_the_seed_variable_as_int_does(Fabric, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "+5")
    assert Fabric.seed_everything() == 5


def test_a_spawn_strategy_needs_launch_with_a_function(Fabric):
    """ddp_spawn starts its processes from `launch(fn)`: `launch()` without one is a TypeError, and a setup before
    launch a RuntimeError; on one device it is an ordinary Fabric."""
    with pytest.raises(TypeError):
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch()
    with pytest.raises(RuntimeError):
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).setup(nn.Linear(2, 2))
    single = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=1)
    assert single.world_size == 1


def test_setup_dataloaders_refuses_what_is_not_a_loader_and_takes_at_least_one(Fabric):
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(TypeError):
        fabric.setup_dataloaders(range(4))
    with pytest.raises(ValueError):
        fabric.setup_dataloaders()


def test_log_dict_converts_tensors_inside_nested_metrics(Fabric):
    logger = RecordingLogger()
    Fabric(accelerator="cpu", loggers=logger).log_dict({"loss": {"d": torch.tensor(0.5), "g": 2}}, step=1)
    assert logger.rows == [({"loss": {"d": 0.5, "g": 2}}, 1)]
    assert type(logger.rows[0][0]["loss"]["d"]) is float  # a number, not a tensor that compares equal to one
