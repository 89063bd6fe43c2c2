"""The GPU tier: plain vs wrapped on cuda:0, one step of each mixed precision on CUDA, and DDP on 2 GPUs
against plain DDP under torchrun. Every test is marked `gpu` and skipped where torch sees no CUDA device
(tests/conftest.py); the CPU tiers cover the same code on CPU.

Bitwise comparisons on CUDA need deterministic kernels: each process of these runs imports a sitecustomize
that turns on torch.use_deterministic_algorithms (an op without a deterministic kernel then raises, naming
itself, rather than letting cuDNN or atomics make the two runs differ by rounding).
"""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.parity import run_weights
from benchmarks.workloads import WORKLOADS, flags
from tests.conftest import ROOT, TORCHRUN

pytestmark = pytest.mark.gpu

DETERMINISTIC = """import torch
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False  # benchmark mode may pick a different algorithm in each process
"""


def settings(workload: str) -> list[str]:
    return flags({**WORKLOADS[workload].generated_data, **WORKLOADS[workload].small, "log_every": 2})


def run_on_gpu(tmp_path, args: list[str], timeout: int = 300):
    """`python args...` with deterministic algorithms in every process it starts (ranks included)."""
    hook = tmp_path / "deterministic"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(DETERMINISTIC)
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "4",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS is deterministic only with a fixed workspace
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stderr[-5000:]}"
    return result


def max_difference(a: dict, b: dict, skip: str = "\0") -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a if skip not in k)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_plain_and_wrapped_give_the_same_weights_on_cuda0(tmp_path, workload):
    steps = ["--max-steps", "4"]
    run_on_gpu(tmp_path, ["-m", f"{workload}.train_torch", *settings(workload), *steps,
                          "--out", str(tmp_path / "plain")])
    run_on_gpu(tmp_path, ["-m", f"{workload}.train", *settings(workload), *steps, "--accelerator", "cuda",
                          "--devices", "1", "--out", str(tmp_path / "wrapped")])
    for variant in ("plain", "wrapped"):  # both ran on the GPU: the CUDA allocator has a peak to report
        assert json.loads((tmp_path / variant / "summary.json").read_text())["peak_cuda_mb"] > 0, variant
    assert max_difference(run_weights(tmp_path / "plain"), run_weights(tmp_path / "wrapped")) == 0.0


def adam_lr(workload: str) -> float:
    """The largest Adam learning rate of the workload's defaults (all three train with Adam)."""
    config = importlib.import_module(f"{workload}.config").Config()
    return max(getattr(config, name) for name in ("lr", "lr_encoder", "lr_decoder") if hasattr(config, name))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_one_step_of_each_mixed_precision_on_cuda(tmp_path, workload, precision):
    """One step from the same initial weights as a float32 step. Adam's first update moves each weight by at
    most lr, so the two may differ by 2 lr, never more (a skipped 16-mixed step, loss scale too high,
    moves it by 0); BatchNorm's running statistics are left out, they follow the activations."""
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no native bfloat16 (core refuses emulated bf16)")
    common = ["-m", f"{workload}.train", *settings(workload), "--max-steps", "1", "--accelerator", "cuda",
              "--devices", "1"]
    run_on_gpu(tmp_path, [*common, "--out", str(tmp_path / "fp32")])
    run_on_gpu(tmp_path, [*common, "--precision", precision, "--out", str(tmp_path / precision)])
    mixed, reference = run_weights(tmp_path / precision), run_weights(tmp_path / "fp32")
    assert all(torch.isfinite(value).all() for value in mixed.values())
    assert max_difference(mixed, reference, skip="running_") <= 2 * adam_lr(workload) + 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("workload", ["gan", "autoencoder"])
def test_ddp_on_two_gpus_equals_plain_ddp_under_torchrun(tmp_path, workload):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, torch sees {torch.cuda.device_count()}")
    steps = ["--max-steps", "4"]
    run_on_gpu(tmp_path, [*TORCHRUN, "-m", f"{workload}.train_torch",
                          *settings(workload), *steps, "--out", str(tmp_path / "plain")])
    run_on_gpu(tmp_path, ["-m", f"{workload}.train", *settings(workload), *steps, "--accelerator", "cuda",
                          "--strategy", "ddp", "--devices", "2", "--out", str(tmp_path / "wrapped")])
    # NCCL sums in the same order in both runs (same ranks, same buckets); allow float rounding all the same
    assert max_difference(run_weights(tmp_path / "plain"), run_weights(tmp_path / "wrapped")) < 1e-6
