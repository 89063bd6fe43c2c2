"""Gradient penalties (R1, WGAN-GP) through set-up modules: `fabric.grad` on 2 processes equals one process on the
whole batch under ddp and fsdp in each precision (on the session's 2-rank groups, tests/group.py) and under DeepSpeed ZeRO-1 and -2 (SGD, so a scaled or skipped
gradient would show), what DeepSpeed cannot take refused with the reason, and the GAN's `--r1-gamma` in both
variants."""
import functools
import importlib.util

import pytest
import torch
from torch import nn

from core import Fabric
from tests.conftest import ROOT, TORCHRUN, run
from tests.penalty_parity import discriminator, train

SCRIPT = str(ROOT / "tests" / "penalty_parity.py")
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra")
# 32-true: the same sums in another order. The mixed modes against the same mode on one process: their
# rounding (bf16's 8-bit mantissa) of the split batch differs from the whole one's.
TOLERANCE = {"32-true": 1e-6, "bf16-mixed": 5e-4, "16-mixed": 5e-4}


@functools.cache
def one_process(strategy: str, precision: str, folder) -> dict:
    """The reference: one process on the whole batch, once per session for each precision. DeepSpeed's bf16 holds
    the module in bfloat16 (not autocast): its one process is the engine's too, in a process of its own."""
    if strategy.startswith("deepspeed") and precision != "32-true":
        out = folder / f"{strategy}-{precision}.pt"
        run([SCRIPT, "--strategy", strategy, "--precision", precision, "--out", str(out)], timeout=300)
        return torch.load(out)
    fabric = Fabric(accelerator="cpu", precision=precision, needs={"second_backward"})
    return train(fabric, str(folder / f"single-{precision}.ckpt"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, precision", [
    ("ddp", "32-true"), ("ddp", "bf16-mixed"), ("ddp", "16-mixed"), ("fsdp", "32-true"), ("fsdp", "bf16-mixed"),
    pytest.param("deepspeed_stage_1", "32-true", marks=NEEDS_DEEPSPEED),
    pytest.param("deepspeed_stage_2", "32-true", marks=NEEDS_DEEPSPEED),
    pytest.param("deepspeed_stage_2", "bf16-mixed", marks=NEEDS_DEEPSPEED)])
def test_a_penalty_on_two_processes_equals_one_process_on_the_whole_batch(tmp_path, tmp_path_factory, two_ranks,
                                                                          strategy, precision):
    one = one_process(strategy, precision, tmp_path_factory.getbasetemp())
    two = two_ranks(strategy.split("_")[0]).run(train, str(tmp_path / "two.ckpt"), strategy=strategy,
                                                precision=precision, needs={"second_backward"})[0]
    initial = discriminator().state_dict()
    assert max((one[k].float() - initial[k]).abs().max().item() for k in one) > 0.01  # it trained
    assert max((one[k].float() - two[k].float()).abs().max().item() for k in one) < TOLERANCE[precision]


def test_16_mixed_scales_the_outputs_and_unscales_the_input_gradient():
    """Under 16-mixed the gradient is taken at the loss scale: at the first scale (2^16) float16 overflows, the
    penalty's step is skipped and the scale halved, as GradScaler does for a loss; once it fits, the gradient is
    32-true's with the scale divided out. A bare autograd.grad, which would skip the scale, is refused."""
    x = torch.randn(4, 3)
    torch.manual_seed(0)
    reference = nn.Linear(3, 1)
    inputs = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(reference(inputs).sum(), inputs)
    fabric = Fabric(accelerator="cpu", precision="16-mixed")
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(3, 1))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    skipped = 0
    while True:
        inputs = x.clone().requires_grad_(True)
        (gradient,) = fabric.grad(model(inputs).sum(), inputs)
        if torch.isfinite(gradient).all():
            break
        optimizer.zero_grad()
        fabric.backward(gradient.pow(2).sum())
        optimizer.step()  # inf gradients: skipped, the scale halved
        skipped += 1
        assert skipped < 5
    assert skipped >= 1 and torch.equal(model.weight, reference.weight)  # every overflowing step was skipped
    assert torch.allclose(gradient, expected, atol=1e-3)
    inputs = x.clone().requires_grad_(True)  # a bare autograd.grad is torch's own: unscaled, not refused (no hook)
    (bare,) = torch.autograd.grad(model(inputs).sum(), inputs, create_graph=True)
    assert torch.allclose(bare.float(), expected, atol=1e-2)


@pytest.mark.parametrize("float16_engine", [True, False], ids=["float16 CPU", "no float16 CPU"])
@pytest.mark.parametrize("strategy, precision, reason", [
    ("deepspeed_stage_3", "32-true", "ZeRO-3's partitioned parameters fail"),
    ("deepspeed_stage_2", "32-true", r"needs=\{'second_backward'\}"),
    ("deepspeed_stage_1", "16-mixed", "use bf16-mixed or 32-true"),
    ("deepspeed_stage_1", "16-true", "use bf16-mixed or 32-true")])
def test_deepspeed_refuses_what_its_engines_cannot_take_with_the_reason(monkeypatch, float16_engine, strategy,
                                                                       precision, reason):
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU accelerator has a float16 engine only where oneDNN does float16 (AVX512-FP16, AMX-FP16): both
    # answers, whatever this CPU's, as core reads it
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: float16_engine)
    if precision.startswith("16-") and not float16_engine:  # refused before setup
        with pytest.raises(ValueError, match="accelerator has no float16 engine. Use 'bf16-mixed' or '32-true'"):
            Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision)
        return
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision)
    with pytest.raises(RuntimeError, match=reason):
        fabric.strategy.keep_for_second_backward(None, [])


def test_a_script_that_says_it_needs_a_second_backward_gets_it_or_the_reason_before_setup():
    pytest.importorskip("deepspeed")
    zero2 = Fabric(accelerator="cpu", strategy="deepspeed_stage_2", devices=2, needs={"second_backward"}).strategy
    assert zero2.config()["zero_optimization"]["contiguous_gradients"] is False
    zero2.keep_for_second_backward(None, [])  # takes it
    assert Fabric(accelerator="cpu", strategy="ddp", devices=2, needs={"second_backward"}).strategy.needs == \
        {"second_backward"}
    with pytest.raises(ValueError, match="strategy='deepspeed_stage_3' cannot give this script second_backward: "
                                         "ZeRO-3's partitioned parameters fail"):
        Fabric(accelerator="cpu", strategy="deepspeed_stage_3", devices=2, needs={"second_backward"})
    with pytest.raises(ValueError, match="cannot give this script weights_outside_forward: ZeRO-3 holds each"):
        Fabric(accelerator="cpu", strategy="deepspeed", config={"zero_optimization": {"stage": 3}}, devices=2,
               needs={"weights_outside_forward"})
    with pytest.raises(ValueError, match=r"Unknown needs \['gradient'\]; a script may say it needs: second_backward"):
        Fabric(accelerator="cpu", needs={"gradient"})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gans_r1_under_ddp_equals_the_plain_script_under_torchrun_bitwise(tmp_path):
    flags = ["--r1-gamma", "1", "--r1-every", "4", "--max-steps", "12", "--batch-size", "16", "--eval-samples", "16"]
    run(["-m", "gan.train", "--strategy", "ddp", "--devices", "2", *flags, "--out", str(tmp_path / "wrapped")],
        timeout=300)
    run([*TORCHRUN, "-m", "gan.train_torch", *flags, "--out", str(tmp_path / "plain")], timeout=300)
    run(["-m", "gan.train", "--strategy", "ddp", "--devices", "2", *flags[4:], "--out", str(tmp_path / "none")],
        timeout=300)
    load = lambda name: torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)  # noqa: E731
    wrapped, plain, none = load("wrapped"), load("plain"), load("none")
    for model in ("generator", "discriminator"):
        assert all(torch.equal(wrapped[model][k], plain[model][k]) for k in wrapped[model])
    assert not all(torch.equal(wrapped["discriminator"][k], none["discriminator"][k]) for k in none["discriminator"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("deepspeed_stage_1", marks=NEEDS_DEEPSPEED),
                                      pytest.param("deepspeed_stage_2", marks=NEEDS_DEEPSPEED)])
def test_the_gans_r1_runs_on_the_default_data(tmp_path, strategy):
    run(["-m", "gan.train", "--r1-gamma", "1", "--strategy", strategy, "--devices", "2", "--max-steps", "30",
         "--out", str(tmp_path / "run")], timeout=300)
    assert (tmp_path / "run" / "summary.json").exists()


def test_the_gan_refuses_r1_under_zero_3_with_one_line():
    result = run(["-m", "gan.train", "--r1-gamma", "1", "--strategy", "deepspeed_stage_3", "--devices", "2"],
                 check=False)
    assert result.returncode == 2, result.stderr
    assert "--strategy deepspeed_stage_3 cannot run this workload, which needs a backward through a gradient of a " \
        "set-up model (fabric.grad with create_graph: R1, WGAN-GP): ZeRO-3's partitioned parameters fail" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
