"""core as a drop-in for Lightning Fabric scripts: the API items Fabric's users rely on, on one process and
on two gloo processes, and a script written the way Fabric's documentation shows, run on core and on
Lightning (where installed) with bitwise equal losses."""
import csv
import importlib.util
import json
import os

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

from core import seed_everything
from core.compat import CSVLogger, Fabric, TensorBoardLogger
from core.loaders import ShardedSampler
from tests.conftest import TORCHRUN, run


def spawn(two_ranks, fn, *args):
    """`fn(fabric, *args)` under the drop-in's ddp on 2 ranks (the session's group, tests/group.py): rank 0's result."""
    return two_ranks("ddp").run(fn, *args, impl="compat")[0]


# --- construction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("alias, mode", [("bf16", "bf16-mixed"), ("16", "16-mixed"), (16, "16-mixed"), (32, "32-true"),
                                         ("32", "32-true"), (64, "64-true"), ("16-true", "16-true")])
def test_precision_aliases(alias, mode):
    assert Fabric(accelerator="cpu", precision=alias)._precision.name == mode


def test_64_and_16_true_convert_the_module_and_inputs():
    for precision, dtype in (("64-true", torch.float64), ("16-true", torch.float16)):
        model = Fabric(accelerator="cpu", precision=precision).setup(nn.Linear(4, 2))
        assert model.dtype == dtype and model(torch.randn(3, 4)).dtype == torch.float32  # outputs: the default dtype


@pytest.mark.parametrize("kwargs, error, message", [
    ({"foo": 1}, TypeError, r"Fabric\(\) got unknown argument\(s\) \['foo'\]. It takes accelerator"),
    ({"strategy": "ddp", "devices": 2, "find_unused": True}, TypeError, "which DistributedDataParallel does not take"),
    ({"strategy": "fsdp", "devices": 2, "wrap": []}, TypeError, "Its options: cpu_offload, reshard_after_forward"),
    ({"plugins": ["x"]}, ValueError, "core takes no plugins"),
])
def test_unknown_constructor_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        Fabric(accelerator="cpu", **kwargs)


def test_arguments_from_fabric_run_environment(monkeypatch):
    monkeypatch.setenv("LT_ACCELERATOR", "cpu")
    monkeypatch.setenv("LT_PRECISION", "bf16-mixed")
    fabric = Fabric()  # configured by the environment that `fabric run` sets
    assert fabric.device.type == "cpu" and fabric._precision.name == "bf16-mixed"
    # outside `fabric run` (no LT_CLI_USED), a value written in the code wins over a stray LT_ variable
    assert Fabric(precision="16-mixed")._precision.name == "16-mixed"
    monkeypatch.setenv("LT_CLI_USED", "1")
    with pytest.raises(ValueError, match=r"Fabric\(precision='16-mixed'\) but the command line gives "
                                         r"--precision=bf16-mixed"):
        Fabric(precision="16-mixed")
    fabric = Fabric()
    with pytest.raises(RuntimeError, match="started by `fabric run`.*remove the fabric.launch"):
        fabric.launch()


def test_before_launch_world_size_is_known_and_loaders_refuse():
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    assert (fabric.world_size, fabric.global_rank) == (2, 0)
    with pytest.raises(RuntimeError, match="call `fabric.launch\\(\\)` before setup"):
        fabric.setup_dataloaders(DataLoader(range(4)))


# --- loggers and callbacks ------------------------------------------------------------------------
def test_log_dict_writes_every_logger_and_call_filters_keywords(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")

    class Recorder:
        def __init__(self):
            self.seen = []

        def on_epoch_end(self, epoch):
            self.seen.append(epoch)

        def on_anything(self, **kwargs):
            self.seen.append(kwargs)

    recorder, csv_logger = Recorder(), CSVLogger(tmp_path / "csv")
    fabric = Fabric(accelerator="cpu", loggers=[csv_logger, TensorBoardLogger(tmp_path / "tb")], callbacks=recorder)
    assert fabric.logger is csv_logger and len(fabric.loggers) == 2
    fabric.log("loss", torch.tensor(0.5), step=0)
    fabric.log_dict({"loss": 0.25, "accuracy": torch.tensor(0.75)}, step=1)
    for logger in fabric.loggers:
        logger.finalize("success")
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    assert rows == [{"step": "0", "loss": "0.5", "accuracy": ""}, {"step": "1", "loss": "0.25", "accuracy": "0.75"}]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    fabric.call("on_epoch_end", epoch=3, losses=[1.0])  # losses is not a parameter of on_epoch_end
    fabric.call("on_anything", a=1)
    fabric.call("on_missing")
    assert recorder.seen == [3, {"a": 1}]


def test_csv_logger_resumed_at_a_step_keeps_the_rows_up_to_it(tmp_path):
    first = CSVLogger(tmp_path)
    for step in (10, 20, 30):  # logged every 10; the run then died after its checkpoint at 20
        first.log_metrics({"loss": step / 10}, step=step)
    first.finalize()
    resumed = CSVLogger(tmp_path, start_step=20)
    resumed.log_metrics({"loss": 2.5, "lr": 0.1}, step=25)  # resumed with another log interval and a new metric
    resumed.finalize()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [(row["step"], row["loss"], row["lr"]) for row in rows] == [("10", "1.0", ""), ("20", "2.0", ""),
                                                                       ("25", "2.5", "0.1")]


def test_csv_logger_writes_each_row_as_it_is_logged(tmp_path):
    """No buffer and no exit hook: a run killed after a log call keeps that row (and the widened header)."""
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=1)
    assert list(csv.DictReader(open(tmp_path / "metrics.csv"))) == [{"step": "1", "loss": "1.0"}]
    logger.log_metrics({"loss": 0.5, "lr": 0.1}, step=2)
    assert list(csv.DictReader(open(tmp_path / "metrics.csv"))) == [{"step": "1", "loss": "1.0", "lr": ""},
                                                                    {"step": "2", "loss": "0.5", "lr": "0.1"}]


# --- modules ----------------------------------------------------------------------------------------
class Steps(nn.Module):
    """LightningModule-style: the step method calls the children."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.decoder = nn.Linear(4, 2), nn.Linear(2, 4)

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, x):
        return F.mse_loss(self.decoder(self.encoder(x)), x)


def test_a_step_after_a_plain_backward_is_refused_where_fabric_backward_is_needed():
    """Under 16-mixed the scaler would unscale gradients no one scaled: the set-up optimizer refuses to step on
    them, and steps after fabric.backward, also where one backward feeds two optimizers (a loss through two
    set-up models) or where each has its own (a GAN)."""
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    model = Steps()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"loss.backward\(\) was called where .* needs fabric.backward\(loss\)"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing stepped
    optimizer.zero_grad()
    fabric.backward(model(torch.randn(3, 4)).float().sum())  # the same through fabric: fine
    optimizer.step()

    encoder, decoder = nn.Linear(4, 2), nn.Linear(2, 4)
    encoder, optimizer_e = fabric.setup(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1))
    decoder, optimizer_d = fabric.setup(decoder, torch.optim.SGD(decoder.parameters(), lr=0.1))
    for _ in range(2):
        fabric.backward(decoder(encoder(torch.randn(3, 4))).float().sum())  # one backward, two optimizers
        optimizer_e.step()
        optimizer_d.step()
        fabric.backward(encoder(torch.randn(3, 4)).float().sum())  # a backward and a step per model
        optimizer_e.step()
        fabric.backward(decoder(torch.randn(3, 2)).float().sum())
        optimizer_d.step()
    decoder(torch.randn(3, 2)).float().sum().backward()
    with pytest.raises(RuntimeError, match="no fabric.backward"):
        optimizer_d.step()

    plain, model = Fabric(accelerator="cpu"), Steps()
    model, optimizer = plain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(3, 4)).sum().backward()  # 32-true: loss.backward() is what fabric.backward does
    optimizer.step()


def test_init_module_creates_on_the_device_in_the_dtype_and_can_skip_init():
    fabric = Fabric(accelerator="cpu", precision="bf16-true")
    with fabric.init_module():
        model = nn.Linear(4, 2)
    assert model.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32

    class Constant(nn.Linear):
        def reset_parameters(self):
            nn.init.constant_(self.weight, 5.0)

    with Fabric(accelerator="cpu").init_module(empty_init=True):
        skipped = Constant(64, 64)
    assert not torch.all(skipped.weight == 5.0)  # left as allocated: a checkpoint will fill it
    assert torch.all(Constant(2, 2).weight == 5.0)


def test_load_raw_and_a_plain_torch_save_dict(tmp_path):
    fabric = Fabric(accelerator="cpu")
    source = Steps()
    model = fabric.setup(Steps())
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(source(torch.ones(2, 4)), torch.zeros(2, 4)).backward()
    optimizer.step()  # the source now differs from the set-up model, and its optimizer has state
    torch.save(source.state_dict(), tmp_path / "raw.pt")
    fabric.load_raw(tmp_path / "raw.pt", model)
    assert torch.equal(model.module.encoder.weight, source.encoder.weight)

    fresh = Steps()
    wrapped, wrapped_optimizer = fabric.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    torch.save({"model": source.state_dict(), "optimizer": optimizer.state_dict(), "step": 7}, tmp_path / "plain.pt")
    state = {"model": wrapped, "optimizer": wrapped_optimizer, "step": 0}  # a checkpoint made without core
    fabric.load(tmp_path / "plain.pt", state)
    assert state["step"] == 7 and torch.equal(wrapped.module.decoder.bias, source.decoder.bias)
    assert torch.equal(wrapped_optimizer.state_dict()["state"][0]["momentum_buffer"],
                       optimizer.state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_compiled_module_keeps_its_compilation_and_its_names(precision):
    fabric = Fabric(accelerator="cpu", precision=precision)
    model = Steps()
    compiled = torch.compile(model, backend="eager")
    wrapped, optimizer = fabric.setup(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    assert wrapped.module is model and list(wrapped.state_dict()) == list(model.state_dict())  # no _orig_mod.
    assert type(wrapped._forward_module).__name__ == "OptimizedModule"
    x = torch.randn(3, 4)
    with torch.no_grad(), fabric.autocast():
        expected = model(x).float()
    assert torch.allclose(wrapped(x), expected)


# --- data -------------------------------------------------------------------------------------------
class Draws(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return numpy.random.randint(0, 2**31)


def draws(rank: int, workers: bool) -> list[int]:
    """What a rank's 2 data workers draw from NumPy, on a loader seeded the same way on every rank."""
    seed_everything(3, workers=workers)
    fabric = Fabric(accelerator="cpu")
    fabric._strategy.global_rank = rank  # the seeding reads only the rank
    loader = fabric.setup_dataloaders(DataLoader(Draws(), batch_size=1, num_workers=2))
    return [int(batch) for batch in loader]


def test_seed_everything_workers_gives_each_rank_its_own_worker_seeds():
    try:
        assert draws(0, workers=False) == draws(1, workers=False)  # torch seeds workers, but not by rank
        seeded = draws(0, workers=True)
        assert seeded != draws(1, workers=True) and seeded == draws(0, workers=True)  # by rank, reproducible
        assert len(set(seeded)) == 4  # and still by worker
    finally:
        os.environ.pop("PL_SEED_WORKERS")


def test_sharded_sampler_shares_out_any_sampler():
    order = list(range(10))[::-1]
    parts = [list(ShardedSampler(order, num_replicas=3, rank=rank)) for rank in range(3)]
    assert parts == [[9, 6, 3, 0], [8, 5, 2, 9], [7, 4, 1, 8]]  # padded from the start, as DistributedSampler


def _samplers(fabric):
    seed_everything(7)
    dataset = TensorDataset(torch.arange(20))
    subset = SubsetRandomSampler(list(range(0, 20, 2)), generator=torch.Generator().manual_seed(1))
    weighted = WeightedRandomSampler([1.0] * 20, num_samples=8, generator=torch.Generator().manual_seed(2))
    result = {}
    for name, sampler in (("subset", subset), ("weighted", weighted)):
        loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=2, sampler=sampler))
        mine = [int(i) for (batch,) in loader for i in batch]
        result[name] = fabric.all_gather(torch.tensor(mine)).tolist()
    shuffled = fabric.setup_dataloaders(DataLoader(dataset, batch_size=2, shuffle=True))
    result["seed"] = shuffled.sampler.seed
    return result


@pytest.mark.multiprocess
def test_custom_samplers_are_shared_out_under_ddp_and_the_seed_is_seed_everythings(two_ranks):
    result = spawn(two_ranks, _samplers)
    subset, weighted = result["subset"], result["weighted"]
    assert sorted(subset[0] + subset[1]) == list(range(0, 20, 2))  # each index once, across the two ranks
    assert len(weighted[0]) == len(weighted[1]) == 4
    assert result["seed"] == 7


# --- collectives and rank order -------------------------------------------------------------------------
def _collectives(fabric, path):
    import time
    rank = fabric.global_rank
    with fabric.rank_zero_first():
        if rank == 0:
            time.sleep(1)  # rank 1, were it not waiting, would look for the file now
            with open(path, "w") as f:
                f.write("written by rank 0")
        found = os.path.exists(path)
    found_on_every_rank = bool(fabric.all_reduce(torch.tensor(int(found)), reduce_op="min"))
    logger = CSVLogger(os.path.dirname(path))  # both ranks log; only rank 0 writes
    logger.log_metrics({"rank": rank}, step=0)
    logger.finalize()
    data = {"loss": torch.tensor(float(rank + 1)), "parts": [rank + 1, torch.tensor([rank, 10 * rank])]}
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    gathered = fabric.all_gather(x * (rank + 1), sync_grads=True)
    gathered.sum().backward()
    return {"first": found_on_every_rank, "mean": fabric.all_reduce(data)["loss"].item(),
            "sum": fabric.all_reduce(data, reduce_op="sum")["parts"][1].tolist(),
            "max": fabric.all_reduce(data, reduce_op="max")["parts"][0].item(),
            "min": fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="min").item(),
            "gather": fabric.all_gather({"rank": torch.tensor(rank)})["rank"].tolist(),
            "grad": x.grad.tolist()}


@pytest.mark.multiprocess
def test_rank_zero_first_and_collectives_over_collections(tmp_path, two_ranks):
    result = spawn(two_ranks, _collectives, str(tmp_path / "shared.txt"))
    assert result["first"]  # rank 1 found the file rank 0 wrote first
    assert list(csv.DictReader(open(tmp_path / "metrics.csv"))) == [{"step": "0", "rank": "0"}]
    assert result["mean"] == 1.5 and result["sum"] == [1, 10] and result["max"] == 2 and result["min"] == 1.0
    assert result["gather"] == [0, 1]
    # both ranks' losses sum rank 0's slice x * 1; its gradient comes back summed over the 2 ranks: 2 * 1
    assert result["grad"] == [2.0, 2.0]
    one = Fabric(accelerator="cpu")
    assert one.all_gather(torch.ones(2)).shape == (2,)  # one process: the data as it is (Lightning's rule)
    assert one.all_reduce({"a": 2})["a"].item() == 2
    with pytest.raises(ValueError, match="reduce_op must be one of mean, avg, sum"):
        one.all_reduce(torch.ones(1), reduce_op="median")


def _step_methods(fabric):
    model = Steps()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.full((3, 4), float(fabric.global_rank + 1))
    fabric.backward(model.training_step(x))  # no submodule guard error: the step went through DDP
    grads = fabric.all_gather(model.module.encoder.weight.grad)
    return bool(torch.equal(grads[0], grads[1]))


@pytest.mark.multiprocess
def test_step_methods_go_through_the_ddp_wrapper(two_ranks):
    assert spawn(two_ranks, _step_methods)


# --- the same script on core and on Lightning ---------------------------------------------------------
def run_script(tmp_path, impl: str, devices: int, precision: str = "32-true") -> dict:
    out = tmp_path / impl / f"result-{devices}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # on one device Lightning calls training_step directly (outside autocast); core routes it through the
    # wrapper everywhere, so under a mixed precision the two compare the loss computed in forward
    forward = ["--loss-in-forward"] if precision != "32-true" else []
    run(["tests/fabric_script.py", "--impl", impl, "--devices", str(devices), "--precision", precision,
         "--out", str(out), *forward], timeout=300)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("devices, precision", [(1, "32-true"), (1, "bf16-mixed"), (2, "32-true")])
def test_a_fabric_script_gives_lightnings_losses_bitwise(tmp_path, devices, precision):
    ours = run_script(tmp_path, "core", devices, precision)
    assert ours["world_size"] == devices and ours["epochs"] == [0, 1] and ours["ranks"] == list(range(devices))
    assert ours["step"] == len(ours["losses"]) == 24 // devices
    pytest.importorskip("lightning", reason="compares with Lightning Fabric: pip install -e '.[bench]'")
    theirs = run_script(tmp_path, "lightning", devices, precision)
    assert ours["losses"] == theirs["losses"]
    assert ours["weights"] == theirs["weights"]
    if devices == 1:  # what Lightning's fabric.save wrote loads on core, optimizer state included
        from tests.fabric_script import AutoEncoder
        fabric = Fabric(accelerator="cpu")
        model = AutoEncoder()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(tmp_path / "lightning" / "lightning.ckpt", state)
        assert state["step"] == 24 and {k: v.tolist() for k, v in model.state_dict().items()} == theirs["weights"]
        assert len(optimizer.state) == len(list(model.parameters()))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fabric_run_starts_the_processes(tmp_path):
    """What `fabric run --accelerator cpu --devices 2 script.py` does: LT_* variables, then torchrun."""
    env = {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cpu", "LT_DEVICES": "2", "LT_NUM_NODES": "1"}
    out = tmp_path / "result.json"
    script = tmp_path / "script.py"
    script.write_text(
        "import json, sys, torch\nfrom core.compat import Fabric\nfabric = Fabric()  # no launch(): the CLI started the ranks\n"
        "total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op='sum')\n"
        "if fabric.global_rank == 0:\n"
        "    json.dump({'world_size': fabric.world_size, 'total': total.item()}, open(sys.argv[1], 'w'))\n")
    command = [*TORCHRUN, str(script), str(out)]
    if all(importlib.util.find_spec(name) for name in ("lightning", "click")):  # Lightning's CLI needs click
        command = ["-m", "lightning.fabric.cli", "--accelerator", "cpu", "--devices", "2", str(script),
                   str(out)]
        env = {}
    print("started by", "lightning.fabric.cli" if not env else "torchrun with fabric run's LT_* variables")
    run(command, timeout=120, env=env)
    assert json.loads(out.read_text()) == {"world_size": 2, "total": 1.0}


def _compiled_under_ddp(fabric):
    model = Steps()
    compiled = torch.compile(model, backend="eager")
    wrapped, optimizer = fabric.setup(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    x = torch.full((3, 4), float(fabric.global_rank + 1))
    fabric.backward(F.mse_loss(wrapped(x), x))
    grads = fabric.all_gather(model.encoder.weight.grad)
    return {"synced": bool(torch.equal(grads[0], grads[1])), "keys": list(wrapped.state_dict()),
            "compiled": type(wrapped._forward_module).__name__, "inner": type(wrapped._forward_module._orig_mod).__name__}


@pytest.mark.multiprocess
def test_a_compiled_module_under_ddp_compiles_the_ddp_wrapper(two_ranks):
    result = spawn(two_ranks, _compiled_under_ddp)
    assert result == {"synced": True, "keys": ["encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"],
                      "compiled": "OptimizedModule", "inner": "DistributedDataParallel"}


FSDP_META_INIT = """
import json, sys, torch
from torch import nn
from core.compat import Fabric
out, reference = sys.argv[1], sys.argv[2]
fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2)
fabric.launch()
with fabric.init_module(empty_init=True):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
on_meta = all(p.device.type == "meta" for p in model.parameters())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
shard_rows = model.module[0].weight.to_local().shape[0]
fabric.load_raw(reference, model)  # the weights a checkpoint gives
torch.manual_seed(fabric.global_rank)
x = torch.randn(4, 8)
fabric.backward(model(x).pow(2).mean())
optimizer.step()
state = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
if fabric.global_rank == 0:
    json.dump({"on_meta": on_meta, "shard_rows": shard_rows, "state": state}, open(out, "w"))
"""


@pytest.mark.multiprocess
def test_init_module_under_fsdp_creates_on_meta_and_setup_materialises_the_shards(tmp_path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    torch.save(plain.state_dict(), tmp_path / "reference.pt")
    script = tmp_path / "meta.py"
    script.write_text(FSDP_META_INIT)
    run([str(script), str(tmp_path / "out.json"), str(tmp_path / "reference.pt")], timeout=180)
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["on_meta"] and result["shard_rows"] == 8  # each rank holds half of the first layer
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    torch.manual_seed(0)
    x0 = torch.randn(4, 8)
    torch.manual_seed(1)
    x1 = torch.randn(4, 8)
    loss = (plain(x0).pow(2).mean() + plain(x1).pow(2).mean()) / 2  # DDP/FSDP average the two ranks' gradients
    loss.backward()
    optimizer.step()
    for key, value in plain.state_dict().items():
        assert torch.allclose(torch.tensor(result["state"][key]), value, atol=1e-6), key
