"""DeepSpeed against plain PyTorch: core's config adds nothing that changes the math, every mode (ZeRO
stages 1-3, both offloads) runs on one process and matches `single`, two processes match one on the full
batch with SGD and Adam, the GAN under ZeRO-2 matches DDP, and a SIGKILLed run resumes exactly."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from benchmarks.workloads import WORKLOADS, flags
from benchmarks.parity import run_weights
from core import CheckpointError, Fabric
from core.checkpoint import load_checkpoint
from tests.conftest import HANG, ROOT, run

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

MODES = ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_2_offload",
         "deepspeed_stage_3_offload")
# the default dataset (embedded digits) with small models, so a run takes seconds; on the CPU, where gloo and
# the kernels are deterministic, so that comparisons can be exact
TINY = {name: [*flags(w.small), "--accelerator", "cpu"] for name, w in WORKLOADS.items() if w.deepspeed}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[key] - b[key]).abs().max().item() for key in a)


# --- the config: DeepSpeed's defaults that change the math are off ----------------------------------
@pytest.mark.parametrize("name", MODES)
def test_config_clips_nothing_and_offload_takes_the_users_optimizer(name):
    config = Fabric(accelerator="cpu", strategy=name, devices=1).strategy.config()
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's own default is 1.0
    assert config["zero_optimization"]["stage"] == int(name.split("_")[2])
    assert ("offload_optimizer" in config["zero_optimization"]) == name.endswith("offload")
    assert config["zero_force_ds_cpu_optimizer"] is False


def test_a_user_config_adds_to_the_strategy_name_and_may_not_contradict_it():
    config = Fabric(accelerator="cpu", strategy="deepspeed_stage_3_offload", devices=1,
                    config={"gradient_clipping": 0.5}).strategy.config()
    assert config["gradient_clipping"] == 0.5
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}
    with pytest.raises(ValueError, match="strategy='deepspeed_stage_3' is ZeRO stage 3, but the DeepSpeed config "
                                         "sets stage 2. Drop the stage from the config, or use strategy='deepspeed'"):
        Fabric(accelerator="cpu", strategy="deepspeed_stage_3", devices=1, config={"zero_optimization": {"stage": 2}})
    assert Fabric(accelerator="cpu", strategy="deepspeed", devices=1, config={"zero_optimization": {"stage": 1}}) \
        .strategy.config()["zero_optimization"]["stage"] == 1


def test_clip_gradients_says_what_to_set():
    fabric = Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=1)
    with pytest.raises(RuntimeError, match=r"Fabric\(strategy='deepspeed_stage_2', config=\{'gradient_clipping': "
                                           r"0.5\}\) clips the 2-norm"):
        fabric.strategy.clip_gradients(None, None, max_norm=0.5)
    with pytest.raises(RuntimeError, match=r"clips gradients by norm only.*config=\{'gradient_clipping': MAX_NORM\}"):
        fabric.strategy.clip_gradients_by_value(None, None, clip_val=0.5)


def test_resume_takes_a_run_directory_or_a_checkpoint_directory(tmp_path):
    from common.resume import resume_path
    from core.cli import FabricFlags

    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"  # what DeepSpeed's fabric.save writes
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"")
    assert resume_path(str(tmp_path / "run")) == checkpoint
    assert resume_path(str(checkpoint)) == checkpoint
    previous = checkpoint.with_name(".last.ckpt.old")  # killed between the save's two renames
    checkpoint.rename(previous)
    with pytest.raises(ValueError, match="no checkpoint at"):  # the plain scripts' saving leaves no such folder
        resume_path(str(tmp_path / "run"))
    assert resume_path(str(tmp_path / "run"), FabricFlags.recover_checkpoint) == checkpoint  # the wrapped ones'
    assert (checkpoint / "state.pt").exists() and not previous.exists()
    with pytest.raises(ValueError, match="no checkpoint at"):
        resume_path(str(tmp_path / "elsewhere"))


# --- one process ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("workload", sorted(TINY))
def test_every_mode_runs_on_one_process_and_matches_single(tmp_path, workload):
    """`python -m WORKLOAD.train --strategy MODE --devices 1`, each its own command as a user runs it: the
    run finishes and its weights are those of `--strategy single` (two commands at a time, 1 thread each)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # the GAN (two engines) in every mode; the autoencoder (one) in the two ZeRO stages that place its weights
    # differently, without and with offload
    modes = MODES if workload == "gan" else ("deepspeed_stage_2", "deepspeed_stage_3_offload")
    commands = {mode: [sys.executable, "-m", f"{workload}.train", *TINY[workload], "--strategy", mode,
                       "--accelerator", "cpu", "--devices", "1",
                       "--max-steps", "3", "--out", str(tmp_path / mode)] for mode in ("single", *modes)}
    pending, running = list(commands.items()), []
    while pending or running:
        while pending and len(running) < 2:
            mode, command = pending.pop(0)
            running.append((mode, subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True)))
        mode, process = running.pop(0)
        output = process.communicate(timeout=300)[0]
        assert process.returncode == 0, f"{mode} exited {process.returncode}:\n{output[-3000:]}"
    single = run_weights(tmp_path / "single")
    for mode in modes:
        assert max_difference(run_weights(tmp_path / mode), single) == 0.0, mode


GROUPS_READ = """
import json, sys, torch
from torch import nn
from core.compat import Fabric  # core.Fabric and the drop-in's save(filter=), which DeepSpeed's engines refuse
from core.checkpoint import read
stage, out = int(sys.argv[1]), sys.argv[2]
fabric = Fabric(accelerator="cpu", strategy=f"deepspeed_stage_{stage}", devices=1)
fabric.launch()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
before = {name: p.detach().clone() for name, p in model.named_parameters()}
groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.01, "momentum": 0.9}]
model, optimizer = fabric.setup(model, torch.optim.SGD(groups, lr=0.5))
fabric.backward(model(torch.randn(3, 4)).sum())
optimizer.step()
fabric.save(out + "/ckpt", {"model": model, "optimizer": optimizer})
saved = read(out + "/ckpt")
try:
    fabric.save(out + "/filtered", {"model": model}, filter={"model": lambda name, value: True})
    refused = None
except TypeError as error:
    refused = str(error)
weights, state = saved["model"], saved["optimizer"]["optimizer"]
# after one SGD step with momentum, the buffer is the gradient: (before - after) / lr
expected = {name: (before[name] - weights[name]) / 0.01 for name in ("2.weight", "2.bias")}
json.dump({"filter": refused, "groups": [(g["lr"], g["momentum"], sorted(g["params"])) for g in state["param_groups"]],
           "buffers": sorted(name for name, entry in state["state"].items() if "momentum_buffer" in entry),
           "error": max((state["state"][n]["momentum_buffer"] - e).abs().max().item() for n, e in expected.items())},
          open(out + "/result.json", "w"))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_reads_each_optimizer_group_with_its_own_state_and_hyperparameters(tmp_path, stage):
    """A group whose optimizer keeps no state (SGD without momentum) beside one that does: read whole, each group
    keeps its own hyperparameters and the other's momentum buffers (ZeRO-2's were dropped, ZeRO-3's read failed)."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    script = tmp_path / "groups.py"
    script.write_text(GROUPS_READ)
    run([str(script), str(stage), str(tmp_path)], timeout=HANG)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["groups"] == [[0.1, 0, ["0.bias", "0.weight"]], [0.01, 0.9, ["2.bias", "2.weight"]]]
    assert result["buffers"] == ["2.bias", "2.weight"] and result["error"] < 1e-5
    assert result["filter"] == f"strategy='deepspeed_stage_{stage}' saves 'model' through DeepSpeed's engine, which " \
        "takes no filter; save without it."


ZERO_3_CHECKS = """
import json, os, pickle, sys, torch
from pathlib import Path
from torch import nn
from common.stopping import check_weights
from core import CheckpointError, Fabric

class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {out / 'pwned'}",))

out = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", strategy="deepspeed_stage_3", devices=1)
fabric.launch()
model = nn.Linear(4, 2)
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
state = {"model": model, "optimizer": optimizer}
result = {"placeholder": model.module.weight.numel() == 0}  # ZeRO-3 keeps the values in ds_tensor
fabric.save(out / "ckpt", state)
# its checksums would refuse the files below first: made a checkpoint without them (no manifest, and a state.pt
# that promises none), what is tested is the reads beneath
(out / "ckpt" / "manifest.json").unlink()
wrapper = torch.load(out / "ckpt" / "state.pt", weights_only=True)
del wrapper["checksums"]
torch.save(wrapper, out / "ckpt" / "state.pt")
# a file of another rank is not this rank's to read; a file that is read is read with weights_only
(out / "ckpt" / "model" / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(pickle.dumps(Exploit()))
fabric.load(out / "ckpt", state)
(out / "ckpt" / "model" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(pickle.dumps(Exploit()))
try:
    fabric.load(out / "ckpt", state)
except CheckpointError as error:
    result["refused"] = str(error)
check_weights(state, 1, out / "ckpt")
model.module.weight.ds_tensor[0] = float("nan")
try:
    check_weights(state, 2, out / "ckpt")
except FloatingPointError as error:
    result["weight_check"] = str(error)
print(json.dumps(result))
"""


@pytest.mark.slow
def test_zero_3_checkpoint_loads_and_weight_check_on_one_process(tmp_path):
    """Each rank reads only its own files, each with weights_only; the weight check reads ZeRO-3's shards."""
    script = tmp_path / "checks.py"
    script.write_text(textwrap.dedent(ZERO_3_CHECKS))
    result = json.loads(run([str(script), str(tmp_path)], timeout=120).stdout.strip().splitlines()[-1])
    assert result["placeholder"]
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt holds objects outside the allowed" in result["refused"]
    assert not (tmp_path / "pwned").exists()
    assert "model has non-finite weights after step 2" in result["weight_check"]


# --- two processes -------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_match_one_process_on_the_full_batch(tmp_path):
    """Every mode with SGD (where any gradient clipping shows) and Adam, in one launch; then save -> load ->
    continue equals the uninterrupted run."""
    out = tmp_path / "result.json"
    run(["tests/dist_parity.py", "--strategy", ",".join(MODES), "--optimizer", "sgd,adam", "--out", str(out)],
        timeout=300)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(f"{mode}/{name}" for mode in MODES for name in ("sgd", "adam"))
    for case, result in results.items():
        assert result["world_size"] == 2 and result["step"] == 5, case
        assert result["max_abs_diff"] < 1e-6, case
        assert result["resumed_max_abs_diff"] == 0.0, case


def start(out: Path, strategy: str, steps: int) -> subprocess.Popen:
    """A 2-process GAN run in a session of its own, so that the whole run can be killed at once."""
    command = [sys.executable, "-m", "gan.train", *TINY["gan"], "--strategy", strategy, "--accelerator", "cpu",
               "--devices", "2",
               "--max-steps", str(steps), "--log-every", "5", "--checkpoint-every", "5", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen) -> None:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-5000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gan_under_zero_2_matches_ddp_after_120_steps(tmp_path):
    """Two models, BatchNorm, Adam, 120 steps: ZeRO-2 computes what DDP computes (bitwise on CPU/gloo)."""
    runs = {strategy: start(tmp_path / strategy, strategy, 120) for strategy in ("ddp", "deepspeed_stage_2")}
    for process in runs.values():
        finish(process)
    assert max_difference(run_weights(tmp_path / "deepspeed_stage_2"), run_weights(tmp_path / "ddp")) == 0.0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, strategy):
    reference, killed = start(tmp_path / "reference", strategy, 40), start(tmp_path / "killed", strategy, 40)
    checkpoint = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + HANG
    while not checkpoint.exists():
        assert killed.poll() is None, killed.communicate()[1][-5000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere in the run after its first checkpoint
    os.killpg(killed.pid, signal.SIGKILL)  # both ranks at once, as when the machine goes down
    killed.communicate()
    saved = load_checkpoint(checkpoint / "state.pt")["step"]
    assert 0 < saved < 40, "the kill did not land mid-run"
    finish(reference)
    run(["-m", "gan.train", *TINY["gan"], "--strategy", strategy, "--accelerator", "cpu", "--devices", "2",
         "--max-steps", "40",
         "--log-every", "5", "--checkpoint-every", "5", "--resume", str(tmp_path / "killed")], timeout=300)
    assert max_difference(run_weights(tmp_path / "killed"), run_weights(tmp_path / "reference")) < 1e-6
    steps = [json.loads(line)["step"] for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # each step logged once across the crash


def test_the_private_deepspeed_functions_core_reads_with_are_there_or_named():
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    import deepspeed
    from deepspeed.utils import zero_to_fp32

    from core.checkpoint import deepspeed as deepspeed_checkpoint
    deepspeed_checkpoint.check_private_api()  # the pinned version has them all
    saved = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint
    try:
        del zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint  # as a later DeepSpeed might
        with pytest.raises(CheckpointError, match=rf"DeepSpeed {re.escape(deepspeed.__version__)} lacks "
                                                  r"deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero3"):
            deepspeed_checkpoint.check_private_api()
    finally:
        zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint = saved
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    method = DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state
    try:
        del DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state  # a method of a class is pinned too
        with pytest.raises(CheckpointError, match=r"lacks deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
                                                  r"._lazy_init_hp_params_optimizer_state"):
            deepspeed_checkpoint.check_private_api()
    finally:
        DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state = method


def test_a_deepspeed_load_that_bypasses_the_safe_loader_is_an_error_not_an_unsafe_read(tmp_path):
    """core shadows the checkpoint engine's `load` (weights-only reads); a DeepSpeed that read its files through
    another method would skip it, so a load that read nothing through it fails, naming the pinned version."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    import deepspeed
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from core.checkpoint.deepspeed import safe_loads
    engine = TorchCheckpointEngine()
    torch.save({"weight": torch.ones(2)}, tmp_path / "file.pt")
    with safe_loads(engine, deepspeed.__version__):
        assert torch.equal(engine.load(str(tmp_path / "file.pt"))["weight"], torch.ones(2))  # through core's reader
    assert "load" not in vars(engine)  # the class's own again
    with pytest.raises(CheckpointError, match="without reading any file through its checkpoint engine's `load`"):
        with safe_loads(engine, deepspeed.__version__):
            torch.load(tmp_path / "file.pt", weights_only=True)  # as a DeepSpeed reading around it would

