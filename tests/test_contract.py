"""core's contract against plain PyTorch, on generated programs (tests/contract.py): CI's budget of them, and
proof that the comparison sees a broken core. The long run a maintainer makes before a release is in
docs/core.md ("The contract, tested")."""
import io

import pytest

from core import loaders, wrappers
from tests.conftest import run
from tests.contract import ONE_PROCESS, run_cells


def test_generated_programs_on_one_process_match_plain_pytorch():
    report = io.StringIO()
    result = run_cells(ONE_PROCESS, seed=0, count=40, out=report)
    assert result["failed"] == 0, report.getvalue()
    assert result["ok"] >= 0.9 * 4 * 40, result  # refusals stay the exception: the programs are mostly legal


@pytest.mark.multiprocess
def test_generated_programs_under_ddp_fsdp_and_deepspeed_match_plain_pytorch():
    result = run(["-m", "tests.contract", "--seed", "0", "--count", "4", "--devices", "2"], timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert '"failed": 0' in result.stdout


@pytest.mark.parametrize("break_core", ["zero_grad does nothing", "no set_epoch"])
def test_the_comparison_sees_a_broken_core(monkeypatch, break_core):
    if break_core == "zero_grad does nothing":
        monkeypatch.setattr(wrappers.FabricOptimizer, "zero_grad", lambda self, *args, **kwargs: None)
    else:
        monkeypatch.setattr(loaders, "epoch_samplers", lambda loader: [])
    report = io.StringIO()
    result = run_cells(["single:32-true"], seed=0, count=20, out=report)
    assert result["failed"] >= 1, result  # a BatchSampler's DistributedSampler over 2 epochs sees set_epoch
    assert "replay: python -m tests.contract --seed 0 --cells single:32-true --index" in report.getvalue()
