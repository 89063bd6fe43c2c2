"""The grouped-module workload: plain vs wrapped, DDP vs one process on the full batch, the run outputs."""
import json

import pytest
import torch

from autoencoder import train, train_torch
from autoencoder.config import Config
from autoencoder.model import AutoEncoder
from benchmarks.workloads import WORKLOADS
from common.config import merge
from core.checkpoint import load_checkpoint
from core.cli import FabricFlags
from tests.conftest import run

TINY = {**WORKLOADS["autoencoder"].generated_data, **WORKLOADS["autoencoder"].small, "latent": 2, "log_every": 2}


def test_plain_and_wrapped_train_bitwise_equal(tmp_path):
    train_torch.main(Config(**TINY, max_steps=6, out=str(tmp_path / "plain")))
    train.main(merge(Config, FabricFlags)(**TINY, max_steps=6, out=str(tmp_path / "wrapped"), accelerator="cpu"))
    plain = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)["model"]
    wrapped = load_checkpoint(tmp_path / "wrapped" / "checkpoints" / "last.ckpt")["model"]
    assert plain.keys() == wrapped.keys()
    assert all(torch.equal(plain[k], wrapped[k]) for k in plain)


def test_run_outputs_and_per_module_learning_rates(tmp_path):
    summary = train.main(merge(Config, FabricFlags)(**TINY, max_steps=4, out=str(tmp_path), accelerator="cpu",
                                                    lr_encoder=1e-3, lr_decoder=5e-4))
    for key in ("test_mse", "test_psnr", "baseline_psnr"):
        assert key in summary
    for name in ("reconstructions.png", "codes.png", "losses.png", "summary.json", "metrics.jsonl"):
        assert (tmp_path / name).is_file(), name
    groups = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["optimizer"]["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [1e-3, 5e-4]


def test_encode_and_decode_compose_to_forward():
    model = AutoEncoder(latent=3)
    x = torch.randn(2, 1, 32, 32)
    assert model.encode(x).shape == (2, 3)
    assert torch.equal(model(x), model.decode(model.encode(x)))
    with pytest.raises(ValueError, match="multiple of 4"):
        AutoEncoder(image_size=30)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_two_processes_equal_one_process_on_the_full_batch(tmp_path):
    common = ["-m", "autoencoder.train", "--dataset", "fake", "--max-steps", "5", "--width", "4", "--latent", "4"]
    run([*common, "--batch-size", "16", "--out", str(tmp_path / "one")])
    run([*common, "--batch-size", "8", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2",
         "--out", str(tmp_path / "two")])
    one = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.ckpt")["model"]
    two = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.ckpt")["model"]
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["steps"] == 5
