"""core across processes (2 CPU processes over gloo): DDP, FSDP and DeepSpeed against one plain process
on the full batch, save -> load -> continue, launching, and failing fast when a rank dies."""
import copy
import json
import os
import pickle
import textwrap
import time

import pytest
import torch
from torch import nn

from core import compat
from tests import dist_parity
from tests.conftest import HANG, ROOT, run
from tests.test_core import Grouped

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("strategy, optimizer, split_setup", [
    ("ddp", "adam", False), ("ddp", "sgd", False), ("fsdp", "adam", False), ("fsdp", "sgd", True),
], ids=["ddp", "ddp-sgd", "fsdp", "fsdp-sgd-split-setup"])
def test_two_processes_match_one_process_on_the_full_batch(two_ranks, strategy, optimizer, split_setup):
    """On the session's 2-rank group (the script, tests/dist_parity.py, runs the same comparison under torchrun's
    two nodes below); DeepSpeed's modes have theirs in test_deepspeed.py, all in one launch."""
    result, _ = two_ranks(strategy).run(dist_parity.compare, optimizer, split_setup)
    assert result["world_size"] == 2
    assert result["max_abs_diff"] < 1e-6
    assert result["resumed_max_abs_diff"] == 0.0  # save -> load -> continue == uninterrupted
    assert result["step"] == 5


def test_two_torchrun_nodes_on_one_machine(tmp_path):
    """num_nodes=2 under torchrun: two 'nodes' of one process each on 127.0.0.1."""
    import subprocess
    import sys
    from benchmarks.overhead import free_port

    port, out = free_port(), tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "tests/dist_parity.py", "--devices", "1", "--num-nodes", "2", "--out", str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    (result,) = json.loads(out.read_text()).values()
    assert result["world_size"] == 2 and result["max_abs_diff"] < 1e-6


def _spawned_step(fabric):
    model = nn.Linear(4, 1)
    torch.manual_seed(0)
    nn.init.normal_(model.weight)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.full((2, 4), float(fabric.global_rank + 1))
    fabric.backward(model(x).sum())
    grads = fabric.all_gather(model.module.weight.grad)
    return {"rank": fabric.global_rank, "synced": bool(torch.equal(grads[0], grads[1])),
            "sum": fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum").item()}


def test_ddp_spawn_runs_a_function_and_returns_rank_zero_result():
    result = compat.Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(_spawned_step)
    assert result == {"rank": 0, "synced": True, "sum": 1.0}


def _submodule_calls(fabric):
    torch.manual_seed(0)
    model = Grouped()
    # encode() leaves the decoder unused, which DDP must be told about, for this model only
    model, _ = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ddp={"find_unused_parameters": True})
    x = torch.full((3, 4), float(fabric.global_rank + 1))
    outputs = []
    model.register_forward_hook(lambda module, args, output: outputs.append(output))
    fabric.backward(model(x).sum())  # the guard lets the children run inside the DDP wrapper's forward
    try:
        model.encoder(x)
        direct = "no error"
    except RuntimeError as error:
        direct = str(error)
    with torch.no_grad():
        model.encoder(x)  # allowed: no gradients to synchronise
    model.mark_forward_method("encode")
    fabric.backward(model.encode(x).sum())
    grads = fabric.all_gather(model.module.encoder.weight.grad)
    return {"direct": direct, "encode_synced": bool(torch.equal(grads[0], grads[1])), "hook_calls": len(outputs),
            "names": [name for name, _ in model.named_parameters()], "device": str(model.device)}


def test_ddp_reports_a_submodule_called_outside_the_wrapper(two_ranks):
    """...and the DDP-wrapped module still reads as the original: its hooks fire, its names are the original's."""
    result = two_ranks("ddp").run(_submodule_calls, impl="compat")[0]
    assert "Submodule 'encoder' of the set-up Grouped was called outside its distributed wrapper" in result["direct"]
    assert result["encode_synced"]
    assert result["hook_calls"] == 1  # model(x) fires it; the marked encode() is not forward
    assert result["names"] == ["encoder.weight", "encoder.bias", "decoder.weight", "decoder.bias"]
    assert result["device"] == "cpu"


def test_module_without_trainable_parameters_is_not_wrapped_in_ddp(two_ranks):
    result = two_ranks("ddp").run(_frozen_module_setup, impl="compat")[0]
    assert result == "not wrapped"


def _frozen_module_setup(fabric):
    teacher = nn.Linear(4, 4).requires_grad_(False)
    wrapped = fabric.setup(teacher)
    return "not wrapped" if wrapped._forward_module is teacher else "wrapped"


def _copies(fabric):
    """Each rank copies its set-up model and optimizer (an EMA or teacher copy) and trains the copy on its own
    input; the copy is a DDP model of its own."""
    torch.manual_seed(0)
    module = Grouped()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    model.mark_forward_method("encode")
    x, result = torch.randn(2, 4) + fabric.global_rank, {}
    for way, copy_of in (("deepcopy", copy.deepcopy), ("pickle", lambda obj: pickle.loads(pickle.dumps(obj)))):
        before = [p.detach().clone() for p in model.parameters()]
        copied, copied_optimizer = copy_of((model, optimizer))
        fabric.backward(copied(x).sum())
        copied_optimizer.step()
        weights = fabric.all_gather(copied.module.encoder.weight.detach())
        try:
            copied.encoder(x)
            guarded = False
        except RuntimeError as error:
            guarded = "outside its distributed wrapper" in str(error)
        with torch.no_grad():
            for p in copied.parameters():
                p.zero_()
        plain = copy_of(model.module)  # the original module alone (an EMA of it): a plain module, unguarded
        plain(x).sum().backward()
        result[way] = {
            "original_untouched": all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            and all(p.grad is None for p in model.parameters()),
            "copy_stepped": not torch.equal(before[0], weights[0]), "copy_synced": torch.equal(weights[0], weights[1]),
            "encode_runs_the_copy": bool((copied.encode(x) == 0).all()), "children_guarded": guarded,
            "module_alone_plain": type(plain) is Grouped and plain.encoder.weight.grad is not None}
    return result


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_copies_of_a_set_up_model_and_optimizer_act_on_themselves_under_ddp(two_ranks, precision):
    """copy.deepcopy and pickle of a DDP-set-up model and its optimizer: the copy steps its own weights, its
    gradients are synchronised across the ranks, its marked method runs its own weights, and its children are
    guarded for the copy; the original is untouched. A copy of the original module alone is a plain module."""
    result = two_ranks("ddp").run(_copies, impl="compat", precision=precision)[0]
    for way in ("deepcopy", "pickle"):
        assert result[way] == {"original_untouched": True, "copy_stepped": True, "copy_synced": True,
                               "encode_runs_the_copy": True, "children_guarded": True,
                               "module_alone_plain": True}, way


def _copy_refusals(fabric) -> list[str]:
    module = nn.Linear(4, 4)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    refusals = []
    for copy_of in (copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))):
        for obj in (model, optimizer):
            try:
                copy_of(obj)
                refusals.append("copied")
            except RuntimeError as error:
                refusals.append(str(error))
    return refusals


COPY_REFUSED = """
import json, sys
from core import Fabric
from tests.test_distributed import _copy_refusals
fabric = Fabric(accelerator="cpu", strategy=sys.argv[1], devices=1)
fabric.launch()
open(sys.argv[2], "w").write(json.dumps(_copy_refusals(fabric)))
"""


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_2"])
def test_a_copy_of_a_model_its_strategy_changed_in_place_is_refused_with_what_to_do(tmp_path, two_ranks, strategy):
    """fsdp shards the model in place and DeepSpeed puts it in an engine: neither can copy it, so core refuses a
    copy or pickle of the model, or of its optimizer (whose step holds the model), with what to do instead. fsdp on
    the session's 2 ranks, DeepSpeed's engine on one process of its own."""
    if strategy == "fsdp":
        refusals = two_ranks("fsdp").run(_copy_refusals)[0]
    else:
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
        script = tmp_path / "copy_refused.py"
        script.write_text(COPY_REFUSED)
        run([str(script), strategy, str(tmp_path / "out.json")], timeout=300)
        refusals = json.loads((tmp_path / "out.json").read_text())
    assert len(refusals) == 4
    for refusal in refusals:
        assert refusal.startswith(f"A model set up under strategy={strategy!r} cannot be copied or pickled")
        assert "copy the module before fabric.setup and set the copy up too" in refusal


KILL_SCRIPT = """
import os, sys, time
from pathlib import Path
from core import Fabric
fabric = Fabric(accelerator="cpu", strategy=sys.argv[3], devices=2)
fabric.launch()
Path(sys.argv[2], f"pid{fabric.global_rank}").write_text(str(os.getpid()))
fabric.barrier()
if fabric.global_rank == int(sys.argv[1]):
    os.kill(os.getpid(), 9)
fabric.barrier()  # the survivor waits here for a rank that will never come
time.sleep(3600)  # longer than the test waits: only the launcher ending this rank lets the run end
"""


@pytest.mark.parametrize("strategy, victim", [("ddp", 1), ("ddp", 0), ("fsdp", 1), ("deepspeed_stage_2", 1)])
def test_a_killed_rank_ends_the_whole_run(tmp_path, strategy, victim):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(KILL_SCRIPT))
    result = run([str(script), str(victim), str(tmp_path), strategy], check=False, timeout=HANG)
    assert result.returncode != 0
    deadline = time.monotonic() + HANG
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "a rank was left behind"
    if victim == 1:
        assert "rank 1 exited with code -9 (SIGKILL)" in result.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent has not reaped it
        return f.read().split()[2] != "Z"


def _sync_controls(fabric):
    """no_backward_sync over two modules, then a synced step; clip_gradients under the strategy."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    first, opt_first = fabric.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
    second, opt_second = fabric.setup(second, torch.optim.SGD(second.parameters(), lr=0.1))
    x = torch.full((2, 4), float(fabric.global_rank + 1))

    with fabric.no_backward_sync(first, second):
        fabric.backward(second(first(x)).sum())
    unsynced = fabric.all_gather(first.module.weight.grad.clone())
    opt_first.zero_grad()
    opt_second.zero_grad()
    fabric.backward(second(first(x)).sum())
    synced = fabric.all_gather(first.module.weight.grad.clone())
    norm = fabric.clip_gradients(first, opt_first, max_norm=1e-3)
    return {"world_size": fabric.world_size, "unsynced_differ": not torch.equal(unsynced[0], unsynced[1]),
            "synced_equal": torch.equal(synced[0], synced[1]), "norm": float(norm)}


def test_no_backward_sync_of_several_modules_and_clipping(two_ranks):
    """The ranks' inputs differ, so their local gradients differ until DDP all-reduces them."""
    result = two_ranks("ddp").run(_sync_controls, impl="compat")[0]
    assert result["world_size"] == 2
    assert result["unsynced_differ"] and result["synced_equal"] and result["norm"] > 1e-3


def _fsdp_checks(fabric):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # built before sharding
    wrapped = fabric.setup_module(model)
    try:
        fabric.setup_optimizers(stale)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    batch = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    fabric.backward(wrapped(batch.chunk(2)[fabric.global_rank]).sum())
    norm = fabric.clip_gradients(wrapped, optimizer, max_norm=1e-3)
    optimizer.step()
    with fabric.no_backward_sync(wrapped):
        fabric.backward(wrapped(torch.randn(3, 4)).sum())
    # one process on both ranks' rows: FSDP averages the ranks' gradients
    (sum(reference(rows).sum() for rows in batch.chunk(2)) / 2).backward()
    whole = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    return {"error": error, "norm": float(norm), "whole": float(whole)}


def test_fsdp_refuses_an_optimizer_of_unsharded_parameters_and_clips(two_ranks):
    """... and clip_gradients returns the norm of the whole gradient on every rank, not of this rank's shard."""
    result = two_ranks("fsdp").run(_fsdp_checks)
    assert "an optimizer built before setup_module holds the unsharded parameters" in result[0]["error"]
    assert "fabric.setup(model, optimizer)" in result[0]["error"]
    assert [r["norm"] for r in result] == pytest.approx([result[0]["whole"]] * 2, rel=1e-5)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_on_one_process(tmp_path):
    """FSDP checkpoints hold full state dicts: a 2-process run resumes on 1 process, another strategy."""
    common = ["-m", "autoencoder.train", "--dataset", "fake", "--width", "4", "--batch-size", "8"]
    run([*common, "--strategy", "fsdp", "--accelerator", "cpu", "--devices", "2", "--max-steps", "3",
         "--out", str(tmp_path)])
    run([*common, "--max-steps", "5", "--strategy", "auto", "--devices", "1", "--resume", str(tmp_path)])
    from core.checkpoint import load_checkpoint
    assert load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["step"] == 5


def _one_bf16_step(fabric) -> dict:
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = model(torch.randn(3, 4))
    fabric.backward(out.sum())
    optimizer.step()
    engine = model._forward_module
    return {"dtype": str(out.dtype), "bf16": engine.bfloat16_enabled(), "clipping": engine.gradient_clipping()}


def test_deepspeed_takes_a_config_file_and_bf16(tmp_path, two_ranks):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    assert two_ranks("deepspeed").run(_one_bf16_step, precision="bf16-mixed", config=str(config))[0] == {
        "dtype": "torch.float32", "bf16": True, "clipping": 1.0}


def _batch_sampler_orders(fabric):
    """Each epoch's order of this rank's share, from a DistributedSampler inside a BatchSampler (set up with
    use_distributed_sampler=False, as core's error for a batch sampler asks), and the plain loop's."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    dataset = torch.arange(16)
    sampler = DistributedSampler(dataset, fabric.world_size, fabric.global_rank, shuffle=True, seed=3)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_sampler=BatchSampler(sampler, 4, False)),
                                      use_distributed_sampler=False)
    plain = DistributedSampler(dataset, fabric.world_size, fabric.global_rank, shuffle=True, seed=3)
    orders = []
    for epoch in range(3):
        plain.set_epoch(epoch)
        orders.append(([i for batch in loader for i in batch.tolist()], list(plain)))
    return orders


def test_a_batch_samplers_distributed_sampler_gets_each_epoch_under_ddp(two_ranks):
    orders = two_ranks("ddp").run(_batch_sampler_orders, impl="compat")[0]
    assert all(core_order == plain_order for core_order, plain_order in orders)
    assert orders[0][0] != orders[1][0]  # a new order each epoch


def _scheduled_steps(fabric) -> dict:
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # on what setup returned
    for _ in range(3):
        fabric.backward(model(torch.randn(3, 4)).sum())
        optimizer.step()
        scheduler.step()
    return {"engine": model._forward_module.optimizer.param_groups[0]["lr"], "scheduler": scheduler.get_last_lr()}


def test_a_scheduler_built_after_setup_under_deepspeed_schedules_the_engines_optimizer(two_ranks):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    assert two_ranks("deepspeed").run(_scheduled_steps, strategy="deepspeed_stage_2")[0] == {
        "engine": 0.125, "scheduler": [0.125]}
