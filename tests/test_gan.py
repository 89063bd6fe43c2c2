"""The DCGAN workload: plain vs wrapped, resume, every dataset loader on generated files, the CLI."""
import gzip
import json
import math
import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.workloads import WORKLOADS
from common.config import merge
from core.checkpoint import read
from core.cli import FabricFlags
from gan import train, train_torch
from gan.config import Config
from gan.data import DatasetNotFound, load_images
from tests.conftest import TORCHRUN, resolved, run
from tests.in_process import run_module

TINY = {**WORKLOADS["gan"].generated_data, **WORKLOADS["gan"].small, "log_every": 2, "sample_every": 1000}


def weights(run_dir, plain=False):
    path = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(path, weights_only=True) if plain else read(path)  # read: a file or fsdp's folder
    return {f"{m}.{k}": v for m in ("generator", "discriminator") for k, v in state[m].items()}


def assert_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_plain_and_wrapped_train_bitwise_equal(tmp_path):
    train_torch.main(Config(**TINY, max_steps=6, out=str(tmp_path / "plain")))
    train.main(merge(Config, FabricFlags)(**TINY, max_steps=6, out=str(tmp_path / "wrapped"), accelerator="cpu"))
    assert_equal(weights(tmp_path / "plain", plain=True), weights(tmp_path / "wrapped"))


DRAWS = {"drawing": ["--sample-every", "1", "--eval-every", "2"], "none": ["--sample-every", "0"]}


@pytest.mark.parametrize("script", [train_torch, train], ids=["plain", "wrapped"])
def test_drawing_for_the_user_leaves_training_bitwise_unchanged(tmp_path, script):
    """Sample grids and scores run the generator in eval mode: a run that draws at every step ends with the
    weights and BatchNorm statistics of a run that draws nothing."""
    config = merge(Config, FabricFlags) if script is train else Config
    cpu = {"accelerator": "cpu"} if script is train else {}
    small = {**WORKLOADS["gan"].small, "max_steps": 4, "log_every": 2}
    script.main(config(**small, sample_every=1, eval_every=2, out=str(tmp_path / "drawing"), **cpu))
    script.main(config(**small, sample_every=0, out=str(tmp_path / "none"), **cpu))
    plain = script is train_torch
    assert_equal(weights(tmp_path / "drawing", plain), weights(tmp_path / "none", plain))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_drawing_for_the_user_leaves_training_unchanged_on_two_processes(tmp_path, strategy):
    flags = ["--strategy", strategy, "--devices", "2", "--max-steps", "4", "--log-every", "2", "--batch-size", "8",
             "--ngf", "8", "--ndf", "8", "--nz", "16", "--eval-samples", "8"]
    for name, draws in DRAWS.items():
        run(["-m", "gan.train", *flags, *draws, "--out", str(tmp_path / name)], timeout=300)
    assert_equal(weights(tmp_path / "drawing"), weights(tmp_path / "none"))


def test_both_variants_compute_d_gradients_in_the_d_step_only(tmp_path, monkeypatch):
    """Equal work: in the G step both variants treat D as a fixed function, so each D parameter gets one
    gradient per step (the D step's), in the plain script as under fabric.frozen."""
    from gan.model import Discriminator
    calls = {"plain": 0, "wrapped": 0}

    def counting(variant):
        class CountingDiscriminator(Discriminator):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                for p in self.parameters():
                    p.register_hook(lambda grad: calls.__setitem__(variant, calls[variant] + 1))
        return CountingDiscriminator

    monkeypatch.setattr(train_torch, "Discriminator", counting("plain"))
    monkeypatch.setattr(train, "Discriminator", counting("wrapped"))
    train_torch.main(Config(**TINY, max_steps=3, out=str(tmp_path / "plain")))
    train.main(merge(Config, FabricFlags)(**TINY, max_steps=3, out=str(tmp_path / "wrapped"), accelerator="cpu"))
    parameters = len(list(Discriminator(TINY["ndf"], 1, 32).parameters()))
    assert calls == {"plain": 3 * parameters, "wrapped": 3 * parameters}


def test_resume_continues_exactly(tmp_path):
    config = merge(Config, FabricFlags)
    train.main(config(**TINY, max_steps=8, out=str(tmp_path / "full"), accelerator="cpu"))
    train.main(config(**TINY, max_steps=4, out=str(tmp_path / "half"), accelerator="cpu"))
    train.main(resolved(config, **TINY, max_steps=8, resume=str(tmp_path / "half"), accelerator="cpu"))
    assert_equal(weights(tmp_path / "full"), weights(tmp_path / "half"))
    steps = [r["step"] for r in map(json.loads, (tmp_path / "half" / "metrics.jsonl").read_text().splitlines())]
    assert steps == [2, 4, 6, 8]  # each logged step once, across the resume


@pytest.mark.slow
def test_default_run_writes_the_run_directory_and_a_score(tmp_path):
    """The headline command on the embedded digits, shortened: every artefact and the score keys."""
    result = run(["-m", "gan.train", "--max-steps", "30", "--log-every", "10", "--sample-every", "15",
                  "--ngf", "8", "--ndf", "8", "--out", str(tmp_path)])
    assert "classifier FID" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    # classifier features are in units of the real features' scale: held-out digits sit near 0 (0.44 here),
    # uniform noise far away (42), and 30 steps of a tiny GAN are nowhere near real digits (87, one class)
    assert summary["fid_real_floor"] < 2 and summary["fid_noise"] > max(10, 20 * summary["fid_real_floor"])
    assert summary["fid_classifier"] > 5 * summary["fid_real_floor"]
    assert 0 <= summary["class_entropy"] <= summary["class_entropy_max"] == pytest.approx(math.log(10))
    for name in ("metrics.jsonl", "config.json", "losses.png", "checkpoints/last.ckpt", "samples/step_000015.png",
                 "samples/step_000030.png"):
        assert (tmp_path / name).is_file(), name


@pytest.mark.slow
def test_the_score_puts_real_digits_at_the_floor_and_noise_and_one_class_far_from_it():
    """The scorer itself, on images whose score is known: real digits score near the real floor with all ten
    classes (entropy near ln 10), uniform noise far above it, 360 copies of one digit far above it with
    entropy 0."""
    from gan.score import score
    train_set, test_set = load_images("digits"), load_images("digits", train=False)
    train_images = torch.stack([image for image, _ in train_set])
    held_out = torch.stack([image for image, _ in test_set])
    picks = torch.randperm(len(train_images), generator=torch.Generator().manual_seed(0))[:len(held_out)]
    real = score(train_images[picks], train_set, test_set, "digits", 32)
    noise = score(torch.rand(held_out.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1, train_set,
                  test_set, "digits", 32)
    one_digit = score(held_out[:1].expand_as(held_out), train_set, test_set, "digits", 32)
    floor = real["fid_real_floor"]
    assert 0 < floor < 2 and real["fid_classifier"] < 1.5 * floor  # training digits: at or below the floor
    assert real["class_entropy"] > 2.2  # the ten digits are about equally common in the data
    assert noise["fid_classifier"] > max(10, 20 * floor)
    assert one_digit["fid_classifier"] > max(10, 20 * floor) and one_digit["class_entropy"] == 0.0


@pytest.mark.multiprocess
# ddp, fsdp in bf16-mixed and ZeRO-3 train the GAN on the default data in the README's commands
# (tests/test_lifecycle.py::test_every_readme_command_runs); here the strategies those do not show
@pytest.mark.parametrize("strategy, precision", [("fsdp", "32-true"), ("deepspeed_stage_2", "32-true")])
@pytest.mark.slow
def test_gan_trains_under_every_strategy_on_two_processes(tmp_path, strategy, precision):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    run(["-m", "gan.train", "--strategy", strategy, "--accelerator", "cpu", "--devices", "2", "--precision", precision,
         "--dataset", "fake", "--max-steps", "4",
         "--batch-size", "8", "--ngf", "8", "--ndf", "8", "--nz", "16", "--log-every", "2", "--eval-samples", "8",
         "--out", str(tmp_path)], timeout=300)
    losses = [json.loads(line)["loss_g"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_plain_variant_under_torchrun_equals_the_wrapped_one_under_ddp(tmp_path):
    """Several steps, so a G step that left DDP's reducer waiting for D gradients would fail the next one."""
    args = ["--dataset", "fake", "--max-steps", "4", "--batch-size", "8", "--ngf", "8", "--ndf", "8", "--nz", "16",
            "--eval-samples", "8"]
    # the plain script takes the GPU when torch sees one, like any plain script: hide it, this is the CPU test
    run([*TORCHRUN, "-m", "gan.train_torch", *args,
         "--out", str(tmp_path / "plain")], timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})
    run(["-m", "gan.train", *args, "--accelerator", "cpu", "--strategy", "ddp", "--devices", "2",
         "--out", str(tmp_path / "wrapped")], timeout=300)
    assert_equal(weights(tmp_path / "plain", plain=True), weights(tmp_path / "wrapped"))


# --- datasets, read by torchvision from files in their real formats --------------------------------
def write_idx(path, array: np.ndarray, compress: bool):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open(f"{path}.gz", "wb") if compress else open(path, "wb")).write(data)


def test_the_embedded_digits_are_scikit_learns():
    from sklearn.datasets import load_digits as sklearn_digits

    from common.images import load_digits
    images, labels = load_digits()
    reference = sklearn_digits()
    assert images.dtype == torch.float32 and labels.dtype == torch.int64
    assert torch.equal(images, torch.tensor(reference.images, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(reference.target))


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")])
def test_mnist_style_idx_files(tmp_path, name, folder):
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("t10k", 4)):
        write_idx(raw / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), compress=False)
        write_idx(raw / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), compress=False)
    dataset = load_images(name, str(tmp_path), 32)
    image, label = dataset[0]
    assert len(dataset) == 12 and image.shape == (1, 32, 32) and -1 <= image.min() and image.max() <= 1
    assert len(load_images(name, str(tmp_path), 32, train=False)) == 4


def test_cifar10_python_batches(tmp_path, monkeypatch):
    # the real release is checked against fixed md5 sums, which generated files cannot match
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *args, **kwargs: True)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8), "labels": [0, 1, 2]}
        pickle.dump(batch, open(folder / name, "wb"))
    pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, open(folder / "batches.meta", "wb"))
    dataset = load_images("cifar10", str(tmp_path), 32)
    assert len(dataset) == 15 and dataset[0][0].shape == (3, 32, 32)


def test_image_folder(tmp_path):
    for cls in ("cats", "dogs"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(np.full((40, 50), 60 * i, dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    dataset = load_images("folder", str(tmp_path), 64)
    assert len(dataset) == 6 and dataset[0][0].shape == (3, 64, 64) and dataset[5][1] == 1


def test_celeba_layout(tmp_path, monkeypatch):
    from torchvision import datasets
    monkeypatch.setattr(datasets.CelebA, "_check_integrity", lambda self: True)
    root = tmp_path / "celeba"
    (root / "img_align_celeba").mkdir(parents=True)
    names = [f"{i:06d}.jpg" for i in range(1, 5)]
    for name in names:
        Image.fromarray(np.zeros((218, 178, 3), dtype=np.uint8)).save(root / "img_align_celeba" / name)
    (root / "list_eval_partition.txt").write_text("".join(f"{n} {0 if i < 3 else 2}\n" for i, n in enumerate(names)))
    (root / "identity_CelebA.txt").write_text("".join(f"{n} {i}\n" for i, n in enumerate(names)))
    (root / "list_attr_celeba.txt").write_text("4\nSmiling Young\n" + "".join(f"{n} 1 -1\n" for n in names))
    (root / "list_bbox_celeba.txt").write_text("4\nimage_id x_1 y_1 width height\n" +
                                              "".join(f"{n} 1 2 3 4\n" for n in names))
    (root / "list_landmarks_align_celeba.txt").write_text("4\nlefteye_x lefteye_y\n" +
                                                         "".join(f"{n} 1 2\n" for n in names))
    dataset = load_images("celeba", str(tmp_path), 64)
    assert len(dataset) == 3 and dataset[0][0].shape == (3, 64, 64)


@pytest.mark.parametrize("name", ["mnist", "cifar10", "celeba", "folder"])
def test_missing_dataset_says_where_the_files_must_be(tmp_path, name):
    with pytest.raises(DatasetNotFound, match=f"dataset {name!r} .*under {tmp_path}|does not exist"):
        load_images(name, str(tmp_path / ("missing" if name == "folder" else "")), 32)


# --- the command line ---------------------------------------------------------------------------
@pytest.mark.slow  # one float16 step on the CPU takes seconds
def test_16_mixed_on_the_cpu_says_so_at_start(tmp_path):
    result = run(["-m", "gan.train", "--precision", "16-mixed", "--accelerator", "cpu", "--max-steps", "1",
                  "--ngf", "8", "--ndf", "8", "--eval-samples", "8", "--out", str(tmp_path)])
    assert result.stderr.splitlines()[0] == (
        "[core] --precision 16-mixed on the CPU: float16 autocast with a loss scaler, about 15x slower than 32-true "
        "here (the CPU's kernels are float32 and bfloat16); --precision bf16-mixed is the CPU's mixed precision.")


@pytest.mark.parametrize("args, message", [
    (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
    (["--strategy", "horovod"], "argument --strategy: invalid choice: 'horovod'"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--accelerator", "tpu"], "argument --accelerator: invalid choice: 'tpu'"),
    (["--devices", "0"], "devices must be a whole number >= 1"),
    (["--devices", "999"], "devices=999 but this machine has"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
    (["--log-every", "0"], "--log-every must be >= 1"),
    (["--sample-every", "-1"], "--sample-every must be >= 0"),
    (["--dataset", "mnist", "--data-root", "/nonexistent"], "--data-root /nonexistent does not exist"),
    (["--strategy", "fsdp", "--precision", "16-mixed"], "'16-mixed' is not supported with strategy='fsdp'"),
    (["--augment", "translation,rotate"], "--augment takes 'none' or a comma-separated list of color, translation"),
    (["--native-size", "32"], "--native-size takes auto or a side in px from 0 to 31 (below --image-size), got '32'"),
    (["--native-size", "eight"], "--native-size takes auto or a side in px from 0 to 31"),
    (["--native-size", "²"], "--native-size takes auto or a side in px from 0 to 31"),
])
def test_cli_misuse_exits_2_with_one_line(args, message, tmp_path):
    """In this process, as `python -m gan.train` runs (tests/in_process.py): each is refused before any process
    starts; tests/test_reliability.py and test_lifecycle.py read the one line of real processes."""
    status, stderr = run_module("gan.train", [*args, "--out", str(tmp_path / "run")], tmp_path)
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m gan.train: error:"), stderr
    assert message in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("script", [train_torch, train], ids=["plain", "wrapped"])
def test_logs_go_to_the_chosen_logger_too_and_survive_a_resume(tmp_path, script):
    """--logger is the same flag with the same files in both variants (common/loggers.py)."""
    import csv
    config = merge(Config, FabricFlags) if script is train else Config
    cpu = {"accelerator": "cpu"} if script is train else {}
    script.main(config(**TINY, max_steps=4, out=str(tmp_path / "run"), **cpu))  # --logger csv: default
    script.main(resolved(config, **TINY, max_steps=8, resume=str(tmp_path / "run"), **cpu))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [int(row["step"]) for row in rows] == [r["step"] for r in records] == [2, 4, 6, 8]
    assert [float(row["loss_d"]) for row in rows] == [r["loss_d"] for r in records]
    script.main(config(**TINY, max_steps=2, out=str(tmp_path / "tb"), logger="tensorboard", **cpu))
    assert any(path.name.startswith("events.out.tfevents") for path in (tmp_path / "tb" / "tensorboard").iterdir())
    assert not (tmp_path / "tb" / "metrics.csv").exists()
