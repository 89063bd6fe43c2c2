"""core on one process: the four setup patterns against plain PyTorch, validation rules, precision,
checkpoints and safe loading."""
import copy
import os
import pickle
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from core import CheckpointError, Fabric, launcher, seed_everything
from core.loaders import FabricDataLoader
from core.nested import move_to
from core.wrappers import FabricModule
from tests.conftest import run


def mlp(seed=0, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))


def data(steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(steps)]


def assert_same_weights(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = mlp(0), nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.body(x))


class Grouped(nn.Module):
    """An encoder and a decoder grouped in one module, with a method to mark (the autoencoder's shape)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = nn.Linear(4, 4), nn.Linear(4, 4)

    def encode(self, x):
        return self.encoder(x)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def run_pattern(pattern: str, fabric: Fabric | None):
    """Train one of the four patterns with plain PyTorch (fabric None) or through fabric."""
    setup = (lambda *a, **k: a if len(a) > 1 else a[0]) if fabric is None else fabric.setup
    backward = (lambda loss: loss.backward()) if fabric is None else fabric.backward
    if pattern == "1 model, 1 optimizer":
        model = mlp()
        model, opt = setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
        for x, y in data():
            opt.zero_grad()
            backward(F.mse_loss(model(x), y))
            opt.step()
        return [model]
    if pattern == "1 model, 2 optimizers":
        model = TwoHeads()
        opt_body = torch.optim.SGD(model.body.parameters(), lr=0.1, momentum=0.9)
        opt_head = torch.optim.Adam(model.head.parameters(), lr=0.01)
        model, opt_body, opt_head = setup(model, opt_body, opt_head)
        for x, y in data():
            opt_body.zero_grad()
            opt_head.zero_grad()
            backward(F.mse_loss(model(x), y))
            opt_body.step()
            opt_head.step()
        return [model]
    if pattern == "2 models grouped, 1 optimizer":
        group = nn.ModuleDict({"encoder": mlp(0), "decoder": nn.Linear(2, 4)})
        opt = torch.optim.Adam([{"params": group["encoder"].parameters(), "lr": 0.01},
                                {"params": group["decoder"].parameters(), "lr": 0.001}])

        class Grouped(nn.Module):
            def __init__(self):
                super().__init__()
                self.parts = group

            def forward(self, x):
                return self.parts["decoder"](self.parts["encoder"](x))

        model = Grouped()
        model, opt = setup(model, opt)
        for x, _ in data():
            opt.zero_grad()
            backward(F.mse_loss(model(x), x))
            opt.step()
        return [model]
    # 2 models, 2 optimizers, set up pair by pair, the second trained through the first
    first, second = mlp(0), nn.Linear(2, 1)
    first, opt_first = setup(first, torch.optim.Adam(first.parameters(), lr=0.01))
    second, opt_second = setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
    for x, y in data():
        opt_second.zero_grad()
        backward(second(first(x).detach()).pow(2).mean())
        opt_second.step()
        opt_first.zero_grad()
        backward((second(first(x)) - 1).pow(2).mean(), **({} if fabric is None else {"model": first}))
        opt_first.step()
    return [first, second]


@pytest.mark.parametrize("pattern", ["1 model, 1 optimizer", "1 model, 2 optimizers",
                                     "2 models grouped, 1 optimizer", "2 models, 2 optimizers"])
def test_patterns_match_plain_pytorch_bitwise(pattern):
    plain = run_pattern(pattern, None)
    wrapped = run_pattern(pattern, Fabric(accelerator="cpu"))
    for a, b in zip(plain, wrapped):
        assert_same_weights(a, b)


def test_return_conventions_and_types():
    fabric = Fabric(accelerator="cpu")
    model = mlp()
    assert isinstance(fabric.setup(model), FabricModule)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    out = fabric.setup(model, opt, scheduler=sched)
    assert len(out) == 3 and out[2] is sched
    assert isinstance(out[1], torch.optim.SGD) and out[1].optimizer is opt
    assert list(out[0].state_dict()) == list(model.state_dict())  # no wrapper prefix
    assert out[0].module is model
    out[1].step()
    sched.step()  # the scheduler changes the learning rate the wrapped optimizer uses
    assert out[1].param_groups[0]["lr"] == pytest.approx(0.01)


def trained_adam_run():
    """A set-up MLP and Adam after four steps."""
    fabric = Fabric(accelerator="cpu")
    model = mlp()
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    for x, y in data():
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
        opt.step()
    return fabric, model, opt


def test_optimizer_state_dict_round_trips():
    fabric, model, opt = trained_adam_run()
    state = opt.state_dict()
    fresh = mlp()
    fresh, fresh_opt = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.5))
    fresh_opt.load_state_dict(state)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_an_optimizer_loaded_by_fabric_load_then_by_load_state_dict_takes_lr_edits(tmp_path):
    """After fabric.load restored it, the wrapper must still be the optimizer that trains: a later
    load_state_dict and an lr edit through param_groups reach the optimizer that steps."""
    fabric, model, opt = trained_adam_run()
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
    fresh = mlp()
    fresh, fresh_opt = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.5))
    fabric.load(tmp_path / "a.ckpt", {"model": fresh, "optimizer": fresh_opt})
    fresh_opt.load_state_dict(opt.state_dict())
    for group in fresh_opt.param_groups:
        group["lr"] = 0.0
    assert fresh_opt.param_groups is fresh_opt.optimizer.param_groups
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    x, y = data(1)[0]
    fabric.backward(F.mse_loss(fresh(x), y))
    fresh_opt.step()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key  # lr 0: nothing moved


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_scheduler_built_on_the_set_up_optimizer_schedules_it(precision):
    """Lightning's docs build the scheduler after setup, from the optimizer setup returned."""
    fabric = Fabric(accelerator="cpu", precision=precision)
    model = mlp()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = data(1)[0]
    for _ in range(3):
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
        opt.step()
        scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.125
    assert scheduler.get_last_lr() == [0.125] and opt.optimizer._opt_called


class TestValidation:
    def test_module_set_up_twice(self):
        fabric = Fabric(accelerator="cpu")
        model = mlp()
        wrapped = fabric.setup(model)
        with pytest.raises(ValueError, match="should be passed only once"):
            fabric.setup(wrapped)
        assert fabric.setup(model).module is model  # the raw module again: accepted, as Lightning does

    def test_optimizer_set_up_twice(self):
        fabric = Fabric(accelerator="cpu")
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _, wrapped_opt = fabric.setup(model, opt)
        with pytest.raises(ValueError, match="optimizer should be passed only once"):
            fabric.setup(mlp(), wrapped_opt)

    def test_empty_setup_calls(self):
        fabric = Fabric(accelerator="cpu")
        with pytest.raises(ValueError, match="requires at least one optimizer"):
            fabric.setup_optimizers()
        with pytest.raises(ValueError, match="requires at least one dataloader"):
            fabric.setup_dataloaders()

    def test_scheduler_without_optimizer(self):
        model = mlp()
        sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
        with pytest.raises(ValueError, match="scheduler was passed to setup without any optimizer"):
            Fabric(accelerator="cpu").setup(model, scheduler=sched)

    def test_optimizer_of_another_module(self):
        model, other = mlp(), mlp(1)
        with pytest.raises(ValueError, match="do not belong to the Sequential"):
            Fabric(accelerator="cpu").setup(model, torch.optim.SGD(other.parameters(), lr=0.1))

    def test_split_setup_optimizer_needs_set_up_module(self):
        fabric = Fabric(accelerator="cpu")
        with pytest.raises(ValueError, match="Create the optimizer after setup_module"):
            fabric.setup_optimizers(torch.optim.SGD(mlp().parameters(), lr=0.1))

    @pytest.mark.parametrize("kwargs, message", [
        ({"strategy": "horovod"}, "Unknown strategy 'horovod'. Choose one of: auto, single, ddp"),
        ({"accelerator": "tpu"}, "Unknown accelerator 'tpu'. Choose one of: auto, cpu, cuda"),
        ({"precision": "fp8"}, "Unknown precision 'fp8'. Choose one of: 32-true, bf16-mixed"),
        ({"devices": 0}, "devices must be a whole number >= 1"),
        ({"devices": 10_000}, "devices=10000 but this machine has"),
        ({"num_nodes": 0}, "num_nodes must be a whole number >= 1"),
        ({"strategy": "single", "devices": 2}, "strategy='single' runs one process"),
    ])
    def test_bad_constructor_arguments(self, kwargs, message):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Fabric(accelerator=kwargs.pop("accelerator", "cpu"), **kwargs)

    def test_cuda_requested_without_cuda(self):
        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            Fabric(accelerator="cuda")

    def test_several_devices_need_launch(self):
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
        with pytest.raises(RuntimeError, match="call `fabric.launch\\(\\)` before setup"):
            fabric.setup(mlp())

    def test_launch_without_a_launcher_for_several_nodes_or_with_a_mismatched_one(self, monkeypatch):
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(RuntimeError, match="num_nodes=2 needs an outside launcher: on each node run `torchrun "
                                               "--nnodes 2 --nproc-per-node 1"):
            launcher.start(devices=1, num_nodes=2)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "3")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        with pytest.raises(RuntimeError, match="started 3 processes, but devices=1 x num_nodes=2 = 2"):
            launcher.start(devices=1, num_nodes=2)

    def test_to_device_moves_nested_tensors_and_keeps_container_types(self):
        Pair = namedtuple("Pair", "x y")
        batch = {"images": [torch.ones(2), (torch.zeros(1), "label")], "pair": Pair(torch.ones(1), 3)}
        moved = move_to(batch, torch.device("meta"))
        assert moved["images"][0].is_meta and moved["images"][1][0].is_meta and moved["images"][1][1] == "label"
        assert isinstance(moved["images"][1], tuple) and isinstance(moved["pair"], Pair)
        assert moved["pair"].x.is_meta and moved["pair"].y == 3

    def test_deepspeed_refuses_split_setup(self):
        pytest.importorskip("deepspeed")
        fabric = Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=1)
        fabric._launched = True  # the check comes before any process group is needed
        with pytest.raises(RuntimeError, match="must be set up jointly"):
            fabric.setup_module(mlp())
        with pytest.raises(RuntimeError, match="must be set up jointly"):
            fabric.setup_optimizers(torch.optim.SGD(mlp().parameters(), lr=0.1))

    def test_unknown_module_option_namespace(self):
        with pytest.raises(TypeError, match="per-module options are passed by strategy"):
            Fabric(accelerator="cpu").setup(mlp(), find_unused_parameters=True)


def test_mark_forward_method_routes_through_wrapper():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

        def double(self, x):
            return 2 * self.lin(x)

    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    model = fabric.setup(Net())
    model.mark_forward_method("double")
    out = model.double(torch.randn(2, 4))
    assert out.dtype == torch.float32  # went through autocast and the output conversion
    assert model.module.forward.__func__ is Net.forward  # the redirection is undone
    with pytest.raises(AttributeError, match="has no method 'triple'"):
        model.mark_forward_method("triple")


def test_frozen_stops_parameter_gradients_but_not_input_gradients():
    fabric = Fabric(accelerator="cpu")
    generator, discriminator = mlp(0), nn.Linear(2, 1)
    generator, _ = fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    discriminator, _ = fabric.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1))
    with fabric.frozen(discriminator):
        loss = discriminator(generator(torch.randn(3, 4))).mean()
    fabric.backward(loss)  # the loss reaches one model only, so no model= is needed
    assert all(p.grad is None for p in discriminator.parameters())
    assert all(p.grad is not None for p in generator.parameters())
    assert all(p.requires_grad for p in discriminator.parameters())  # restored afterwards


def test_a_gradient_through_two_models_without_model_is_refused_with_both_names():
    """fabric.grad finds the model a penalty is for in the outputs' graph; through both models it cannot tell, and
    says which models it reached and how to choose; with the other model frozen it can."""
    fabric = Fabric(accelerator="cpu")
    generator, discriminator = mlp(0), nn.Linear(2, 1)
    generator, _ = fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    discriminator, _ = fabric.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"it reaches the parameters of Sequential, Linear\. Pass it: "
                                         r"`fabric.backward\(loss, model=generator\)`"):
        fabric.grad(discriminator(generator(x)).sum(), x)
    with fabric.frozen(discriminator):
        outputs = discriminator(generator(x)).sum()
    (gradient,) = fabric.grad(outputs, x)
    assert gradient.shape == x.shape


class TestPrecision:
    def test_bf16_mixed_autocasts_and_returns_float32(self):
        fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
        model = fabric.setup(nn.Linear(4, 4))
        seen = {}
        model.module.register_forward_hook(lambda m, i, o: seen.update(dtype=o.dtype))
        out = model(torch.randn(2, 4))
        assert seen["dtype"] == torch.bfloat16 and out.dtype == torch.float32
        assert model.module.weight.dtype == torch.float32

    @pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
    def test_a_copy_of_a_set_up_module_runs_its_own_weights(self, precision):
        """copy.deepcopy (an EMA or teacher copy) and pickle of a set-up module give a module that calls its own
        copy of the weights, under every mode's forward."""
        model = Fabric(accelerator="cpu", precision=precision).setup(nn.Linear(4, 4))
        x = torch.randn(2, 4)
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            with torch.no_grad():
                copied.module.weight.zero_()
                copied.module.bias.zero_()
            assert torch.equal(copied(x), torch.zeros(2, 4)) and model(x).abs().sum() > 0

    @pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
    def test_a_copy_of_a_set_up_model_optimizer_and_loader_acts_on_itself(self, precision):
        """A deep copy or pickle of the set-up model, its optimizer (steps through its own OptimizerStep, the
        precision's scaler included) and its loader, taken together as an EMA or snapshot would be: the copy trains
        its own weights on its own batches, its marked method runs its own weights, the original is untouched."""
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", precision=precision)
        module = Grouped()
        # lr 10 on a loss scaled by 1e-3 (no float16 overflow): a step large enough to move bfloat16 weights
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=10.0))
        model.mark_forward_method("encode")
        loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
        for copy_of in (copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))):
            before = [p.detach().clone() for p in model.parameters()]
            copied, copied_optimizer, copied_loader = copy_of((model, optimizer, loader))
            (x,) = next(iter(copied_loader))
            fabric.backward(copied(x).float().sum() * 1e-3)
            copied_optimizer.step()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert all(p.grad is None for p in model.parameters())
            assert not torch.equal(before[0], copied.module.encoder.weight)
            with torch.no_grad():
                for p in copied.parameters():
                    p.zero_()
            assert (copied.encode(x) == 0).all() and (model.encode(x) != 0).any()
            assert len(list(copied_loader)) == 2
            assert torch.equal(copy_of(model.encode)(x), model.encode(x))  # a marked method copied alone runs

    def test_16_mixed_steps_an_optimizer_whose_layers_are_all_frozen(self):
        """GradScaler.step asserts on an optimizer without gradients ("No inf checks were recorded"); core steps
        it directly, a no-op, as in 32-true (found by the contract: a frozen first layer with an optimizer of its
        own)."""
        fabric = Fabric(accelerator="cpu", precision="16-mixed")
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[0].requires_grad_(False)
        model = fabric.setup_module(model)
        frozen = fabric.setup_optimizers(torch.optim.SGD(model.module[0].parameters(), lr=0.1))
        trained = fabric.setup_optimizers(torch.optim.SGD(model.module[1].parameters(), lr=0.1))
        before = [p.detach().clone() for p in model.parameters()]
        fabric.backward(model(torch.randn(2, 4)).sum() * 1e-4)  # small: no overflow at the first loss scale
        frozen.step()
        trained.step()
        after = list(model.parameters())
        assert torch.equal(before[0], after[0]) and not torch.equal(before[2], after[2])
        for _ in range(2):  # clipped too, alone: nothing to unscale, and no unscale_ left pending for the next step
            fabric.backward(model(torch.randn(2, 4)).sum() * 1e-4)
            fabric.clip_gradients(model, frozen, clip_val=1.0)
            frozen.step()
        trained.zero_grad()  # a closure still goes to GradScaler, which refuses it (never a step on scaled gradients)
        with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled"):
            trained.step(lambda: fabric.backward(model(torch.randn(2, 4)).sum()))

    def test_a_set_up_model_unpickled_in_another_process_is_refused_with_what_to_do(self, tmp_path):
        """A set-up object runs through its process's Fabric: another process has none, so unpickling it there is
        refused, naming what to pickle instead; in the same process the copy shares the Fabric (the contract test)."""
        model = Fabric(accelerator="cpu", precision="bf16-mixed").setup(nn.Linear(4, 4))
        (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
        result = run(["-c", f"import pickle; pickle.loads(open({str(tmp_path / 'model.pkl')!r}, 'rb').read())"],
                     check=False)
        assert result.returncode == 1 and "core.errors.CoreRuntimeError: This set-up model or optimizer was pickled " \
            "in process" in result.stderr and "Pickle what it holds instead (`model.module`" in result.stderr

    def test_bf16_true_converts_module_and_inputs(self):
        fabric = Fabric(accelerator="cpu", precision="bf16-true")
        model = fabric.setup(nn.Linear(4, 4))
        assert model.module.weight.dtype == torch.bfloat16
        assert model(torch.randn(2, 4)).dtype == torch.float32  # outputs in the default dtype, as Lightning
    def test_16_mixed_a_loss_through_two_models_trains_as_torchs_one_scaler_recipe(self):
        """One loss through two set-up models, each with its own SGD optimizer, with an overflow in between that
        reaches the second model only: core must train as plain PyTorch with one GradScaler does (a scale that
        each model's optimizer unscaled differently would show as a 2x update under SGD)."""
        fabric = Fabric(accelerator="cpu", precision="16-mixed")
        first, second = mlp(0), nn.Linear(2, 1)
        plain_first, plain_second = mlp(0), nn.Linear(2, 1)
        plain_second.load_state_dict(second.state_dict())
        first, opt_first = fabric.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
        second, opt_second = fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
        plain_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain_first, plain_second)]
        scaler = torch.amp.GradScaler("cpu")
        x = torch.randn(3, 4)
        for through_both in (True, False, True, True):
            factor = 1.0 if through_both else float("inf")  # the second model's own loss overflows
            for opt in (opt_first, opt_second, *plain_opts):
                opt.zero_grad()
            if through_both:
                fabric.backward(second(first(x)).float().mean(), model=first)  # model= as core used to ask
                opt_first.step()
                opt_second.step()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = plain_second(plain_first(x)).float().mean()
                scaler.scale(loss).backward()
                scaler.step(plain_opts[0])
                scaler.step(plain_opts[1])
            else:
                fabric.backward(second(x[:, :2]).float().mean() * factor)
                opt_second.step()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = plain_second(x[:, :2]).float().mean() * factor
                scaler.scale(loss).backward()
                scaler.step(plain_opts[1])
            scaler.update()
        assert_same_weights(first.module, plain_first)
        assert_same_weights(second.module, plain_second)
        assert fabric._precision.state_dict(None)["scale"] == scaler.get_scale() < 65536.0  # backed off once


class TestCheckpoints:
    def setup_run(self):
        return trained_adam_run()

    def test_round_trip_and_unconsumed_keys(self, tmp_path):
        fabric, model, opt = self.setup_run()
        fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": opt, "step": 4, "extra": [1, 2]})
        fresh = mlp(5)
        fresh, fresh_opt = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.5))
        state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
        rest = fabric.load(tmp_path / "a.ckpt", state)
        assert rest == {"extra": [1, 2]} and state["step"] == 4
        assert_same_weights(fresh, model)
        assert fresh_opt.param_groups[0]["lr"] == 0.01

    def test_missing_key_is_an_error_unless_not_strict(self, tmp_path):
        fabric, model, opt = self.setup_run()
        fabric.save(tmp_path / "a.ckpt", {"model": model})
        with pytest.raises(CheckpointError, match="has no \\['optimizer'\\]"):
            fabric.load(tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
        fabric.load(tmp_path / "a.ckpt", {"model": model, "optimizer": opt}, strict=False)

    def test_write_is_atomic(self, tmp_path, monkeypatch):
        fabric, model, opt = self.setup_run()
        path = tmp_path / "a.ckpt"
        fabric.save(path, {"model": model, "step": 1})
        before = path.read_bytes()

        def crash(obj, f, *args, **kwargs):
            f.write(b"partial")
            raise KeyboardInterrupt("killed mid-write")

        monkeypatch.setattr(torch, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            fabric.save(path, {"model": model, "step": 2})
        assert path.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no temporary file left behind

    def test_malicious_pickle_is_refused_without_running(self, tmp_path):
        marker = tmp_path / "pwned"

        class Exploit:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        path = tmp_path / "evil.ckpt"
        with open(path, "wb") as f:
            pickle.dump({"format": "core-checkpoint", "version": 1, "state": Exploit()}, f)
        torch.save({"format": "core-checkpoint", "version": 1, "state": {"x": Exploit()}}, tmp_path / "evil2.ckpt")
        fabric = Fabric(accelerator="cpu")
        for p in (path, tmp_path / "evil2.ckpt"):
            with pytest.raises(CheckpointError, match="refused without running any of it"):
                fabric.load(p, {"x": 0})
        assert not marker.exists()

    def test_truncated_corrupt_foreign_and_missing(self, tmp_path):
        fabric, model, _ = self.setup_run()
        good = tmp_path / "good.ckpt"
        fabric.save(good, {"model": model})
        (tmp_path / "truncated.ckpt").write_bytes(good.read_bytes()[:200])
        (tmp_path / "corrupt.ckpt").write_bytes(b"\x00garbage" * 50)
        torch.save(model.state_dict(), tmp_path / "foreign.ckpt")
        for name, message in [("truncated", "truncated or corrupt"), ("corrupt", "truncated or corrupt"),
                              ("foreign", r"has no \[.model.\] .*fabric.load_raw"), ("missing", "No checkpoint file")]:
            with pytest.raises(CheckpointError, match=message):
                fabric.load(tmp_path / f"{name}.ckpt", {"model": model})

    def test_other_model_shape_names_the_keys(self, tmp_path):
        fabric, model, _ = self.setup_run()
        fabric.save(tmp_path / "a.ckpt", {"model": model})
        other = fabric.setup(mlp(width=16))
        with pytest.raises(CheckpointError, match=r"0.weight: checkpoint \(8, 4\) vs model \(16, 4\)"):
            fabric.load(tmp_path / "a.ckpt", {"model": other})


def test_setup_dataloaders_moves_and_keeps_order_on_one_process():
    dataset = TensorDataset(torch.arange(10.0))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 1, 0, shuffle=True, seed=3))
    wrapped = Fabric(accelerator="cpu").setup_dataloaders(loader)
    assert isinstance(wrapped, FabricDataLoader) and len(wrapped) == 5
    first = [b[0].tolist() for b in wrapped]
    second = [b[0].tolist() for b in wrapped]
    assert first != second  # set_epoch was called: a new order each pass
    loader.sampler.set_epoch(0)
    assert [b[0].tolist() for b in wrapped] == first  # ... unless the caller sets the epoch itself


def test_a_sampler_inside_a_batch_sampler_gets_set_epoch():
    """A DistributedSampler under a BatchSampler (what use_distributed_sampler=False with a batch sampler asks
    the user to build) must draw a new order each pass, as the plain loop's set_epoch gives it."""
    dataset = TensorDataset(torch.arange(16.0))
    sampler = DistributedSampler(dataset, 1, 0, shuffle=True, seed=3)
    batches = torch.utils.data.BatchSampler(sampler, 4, drop_last=False)
    wrapped = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(dataset, batch_sampler=batches))
    plain = DistributedSampler(dataset, 1, 0, shuffle=True, seed=3)
    for epoch in range(3):
        plain.set_epoch(epoch)
        assert [i for b in wrapped for i in b[0].int().tolist()] == list(plain)


def test_seed_everything_is_reproducible():
    seed_everything(7)
    a = torch.rand(3)
    seed_everything(7)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(ValueError, match="seed must be a whole number"):
        seed_everything("seven")  # "7" is 7, as in Lightning (tests/test_fabric_conformance.py)
    with pytest.raises(TypeError, match="seed must be a whole number"):
        seed_everything(7.5)


def test_import_core_does_not_import_heavy_optional_packages():
    import subprocess
    import sys
    code = "import sys, core; print(sorted(m for m in ('deepspeed', 'torchvision', 'matplotlib', 'lightning') " \
           "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    assert out.strip() == "[]"


def test_slurm_and_torchrun_environments_are_detected(monkeypatch):
    from core.launcher import cluster_environment
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    assert cluster_environment() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # set, then removed: the SLURM branch's setdefault is undone after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    env = cluster_environment()
    assert env == {"global_rank": 3, "local_rank": 1, "world_size": 4, "node_rank": 1, "local_world_size": 2}
    assert os.environ["MASTER_ADDR"] == "gpu07"
    monkeypatch.setenv("RANK", "1")  # torchrun's variables win
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cluster_environment()["world_size"] == 2


def test_clip_gradients_by_value_goes_through_the_strategy():
    fabric = Fabric(accelerator="cpu")
    model = mlp()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(4, 4) * 100).pow(2).sum())
    assert max(p.grad.abs().max() for p in model.parameters()) > 0.01
    fabric.clip_gradients(model, optimizer, clip_val=0.01)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 0.01
