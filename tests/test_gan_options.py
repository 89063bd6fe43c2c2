"""The GAN's options: --ema-decay (the average against its closed form, across a resume, under sharding),
--eval-every (best.ckpt and its records), --lr-schedule (the formula, across a resume), --compile and
--augment (each transform against what it must do, its gradient, and what D sees in both variants)."""
import csv
import json
import math

import pytest
import torch

from common.config import merge
from common.ema import EMA
from core.checkpoint import load_checkpoint, read
from core.cli import FabricFlags
from gan import train, train_torch
from gan.augment import Augment, cutout, translation
from gan.config import Config
from tests.conftest import built_once, resolved, run

# the default digits, small models: a few seconds a run
SMALL = {"batch_size": 8, "ngf": 8, "ndf": 8, "nz": 16, "eval_samples": 64, "log_every": 2, "sample_every": 1000}
ARGS = [f"--{key.replace('_', '-')}={value}" for key, value in SMALL.items()]
Wrapped = merge(Config, FabricFlags)


def saved(run_dir, key):
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")[key]


def assert_close(a: dict, b: dict, **tolerance):
    assert a.keys() == b.keys() and a
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=key, **tolerance)


def test_ema_after_k_updates_is_the_closed_form_average():
    model = torch.nn.Linear(3, 2)
    decay, weights = 0.9, [model.weight.detach().clone()]
    ema = EMA(model, decay)
    for k in range(1, 5):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        weights.append(model.weight.detach().clone())
        ema.update()
    # avg_k = d_k avg_(k-1) + (1 - d_k) w_k, d_k = min(0.9, (1 + k) / (10 + k)): unrolled, each w_i weighs
    # (1 - d_i) times the product of the later decays
    d = [min(decay, (1 + k) / (10 + k)) for k in range(1, 5)]
    expected = math.prod(d) * weights[0] + sum((1 - d[i - 1]) * math.prod(d[i:]) * weights[i] for i in range(1, 5))
    torch.testing.assert_close(ema.state_dict()["weight"], expected)
    assert ema.state_dict()["updates"] == 4 and ema.current_decay() == pytest.approx(min(decay, 6 / 15))
    with ema.swapped_in():
        torch.testing.assert_close(model.weight.detach(), expected)
    assert torch.equal(model.weight.detach(), weights[-1])  # the raw weights are back


def test_ema_decay_0_is_the_raw_generator():
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, 0.0)
    with torch.no_grad():
        model.weight.mul_(2)
    raw = model.weight.detach().clone()
    ema.update()
    with ema.swapped_in():
        assert torch.equal(model.weight.detach(), raw)
    assert ema.state_dict() == {}


@pytest.mark.slow  # a run or more with a final score each: 25-65 s on 2 CPU cores
def test_ema_is_checkpointed_and_resumes_exactly(tmp_path):
    train.main(Wrapped(**SMALL, max_steps=6, out=str(tmp_path / "full"), accelerator="cpu"))
    train.main(Wrapped(**SMALL, max_steps=3, out=str(tmp_path / "half"), accelerator="cpu"))
    train.main(resolved(Wrapped, **SMALL, max_steps=6, resume=str(tmp_path / "half"), accelerator="cpu"))
    full, resumed = saved(tmp_path / "full", "ema"), saved(tmp_path / "half", "ema")
    generator = train.Generator(16, 8, 1, 32)  # its parameters, its float buffers (BatchNorm's statistics)
    averaged = [n for n, _ in generator.named_parameters()] + [n for n, b in generator.named_buffers()
                                                               if b.is_floating_point()]
    assert set(full) == {*averaged, "updates"} and full["updates"] == 6
    assert_close(full, resumed, rtol=0, atol=0)
    assert not torch.equal(full["main.0.weight"], saved(tmp_path / "full", "generator")["main.0.weight"])


@pytest.mark.slow  # a run or more with a final score each: 25-65 s on 2 CPU cores
def test_plain_ema_matches_the_wrapped_one_and_scores_both(tmp_path):
    summary = train_torch.main(Config(**SMALL, max_steps=4, out=str(tmp_path / "plain")))
    train.main(Wrapped(**SMALL, max_steps=4, out=str(tmp_path / "wrapped"), accelerator="cpu"))
    plain = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)["ema"]
    assert_close(plain, saved(tmp_path / "wrapped", "ema"), rtol=0, atol=0)
    assert {"fid_classifier", "class_entropy", "raw_fid_classifier", "raw_class_entropy"} <= summary.keys()
    off = train_torch.main(Config(**SMALL, max_steps=4, ema_decay=0, out=str(tmp_path / "off")))
    assert "raw_fid_classifier" not in off and off["fid_classifier"] == pytest.approx(summary["raw_fid_classifier"])


@pytest.mark.slow  # a run or more with a final score each: 25-65 s on 2 CPU cores
@pytest.mark.parametrize("script", [train, train_torch])
def test_eval_every_keeps_the_best_checkpoint_and_records(tmp_path, script):
    config = Wrapped(**SMALL, accelerator="cpu") if script is train else Config(**SMALL)
    config.max_steps, config.eval_every, config.out = 6, 2, str(tmp_path)
    summary = script.main(config)
    records = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
               if "eval_fid_classifier" in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    best = min(records, key=lambda r: r["eval_fid_classifier"])
    assert (summary["best_step"], summary["best_fid_classifier"]) == (best["step"], best["eval_fid_classifier"])
    best_state = torch.load(tmp_path / "checkpoints" / "best.ckpt", weights_only=True)
    assert best_state["step"] == best["step"] == best_state["best_step"]
    with open(tmp_path / "metrics.csv", newline="") as f:  # --logger csv (the default) gets them too
        rows = [row for row in csv.DictReader(f) if row.get("eval_fid_classifier")]
    assert [int(row["step"]) for row in rows] == [2, 4, 6]


def cosine_factor(step, warmup, total):
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


@pytest.mark.slow  # a run or more with a final score each: 25-65 s on 2 CPU cores
def test_cosine_schedule_follows_the_formula_and_resumes_exactly(tmp_path, monkeypatch):
    options = dict(SMALL, lr_schedule="cosine", warmup_steps=2, accelerator="cpu", max_steps=6)
    train.main(Wrapped(**options, out=str(tmp_path / "full")))
    for name in ("scheduler_g", "scheduler_d"):  # the factor of the next step, 6
        assert saved(tmp_path / "full", name)["_last_lr"][0] == pytest.approx(2e-4 * cosine_factor(6, 2, 6))
    assert saved(tmp_path / "full", "scheduler_g")["_last_lr"][0] == 0.0
    # a run that stops after step 3 (as after a SIGTERM: it saves there), resumed to the same --max-steps
    end_step = train.Bookkeeping.end_step
    monkeypatch.setattr(train.Bookkeeping, "end_step",
                        lambda self, *args: end_step(self, *args) or self.state["step"] == 3)
    train.main(Wrapped(**options, out=str(tmp_path / "half")))
    assert saved(tmp_path / "half", "step") == 3
    assert saved(tmp_path / "half", "scheduler_g")["_last_lr"][0] == pytest.approx(2e-4 * cosine_factor(3, 2, 6))
    monkeypatch.setattr(train.Bookkeeping, "end_step", end_step)
    train.main(resolved(Wrapped, **options, resume=str(tmp_path / "half")))
    for key in ("generator", "ema"):
        assert_close(saved(tmp_path / "full", key), saved(tmp_path / "half", key), rtol=0, atol=0)
    assert saved(tmp_path / "full", "scheduler_d") == saved(tmp_path / "half", "scheduler_d")


@pytest.mark.slow  # a run or more with a final score each: 25-65 s on 2 CPU cores
def test_compile_runs_a_few_steps(tmp_path):
    summary = train.main(Wrapped(**SMALL, max_steps=2, compile=True, out=str(tmp_path), accelerator="cpu"))
    assert math.isfinite(summary["fid_classifier"])


def ema_of(run_dir):
    return {k: v.float() for k, v in read(run_dir / "checkpoints" / "last.ckpt")["ema"].items() if k != "updates"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_3"])
def test_sharded_ema_equals_ddp_and_resumes(tmp_path_factory, tmp_path, strategy):
    """The averages of each rank's shards, put together, are the ddp run's (one run for both cells, built once for
    the session's workers); a resumed run gives the same."""
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    common = ["-m", "gan.train", *ARGS, "--accelerator", "cpu", "--devices", "2", "--eval-every", "2"]
    ddp = built_once(tmp_path_factory, "ema-ddp", lambda folder: run(
        [*common, "--strategy", "ddp", "--max-steps", "4", "--out", str(folder / "ddp")], timeout=300))
    run([*common, "--strategy", strategy, "--max-steps", "2", "--out", str(tmp_path / "half")], timeout=300)
    run([*common, "--strategy", strategy, "--max-steps", "4", "--resume", str(tmp_path / "half")], timeout=300)
    assert_close(ema_of(tmp_path / "half"), ema_of(ddp / "ddp"), rtol=1e-4, atol=1e-5)
    summary = json.loads((tmp_path / "half" / "summary.json").read_text())
    assert summary["best_step"] in (2, 4) and (tmp_path / "half" / "checkpoints" / "best.ckpt").exists()


# --- --augment (DiffAugment) ---------------------------------------------------------------------------
def test_translation_shifts_each_image_by_its_own_whole_pixels_and_fills_the_border_with_0():
    images = torch.randn(6, 2, 16, 16)
    shifted = translation(images, torch.Generator().manual_seed(3))
    draws = torch.Generator().manual_seed(3)  # the same draws again: (dy, dx) of each image, within 16 / 8
    dy, dx = (torch.randint(-2, 3, (6, 1), generator=draws)[:, 0] for _ in range(2))
    assert len(set(zip(dy.tolist(), dx.tolist()))) > 1
    for image, out, y, x in zip(images, shifted, dy.tolist(), dx.tolist()):
        expected = torch.zeros_like(image)
        expected[:, max(y, 0):16 + min(y, 0), max(x, 0):16 + min(x, 0)] = \
            image[:, max(-y, 0):16 + min(-y, 0), max(-x, 0):16 + min(-x, 0)]
        assert torch.equal(out, expected)


def test_cutout_zeroes_one_square_of_half_the_side_per_image_and_keeps_the_rest():
    images = torch.rand(8, 1, 16, 16) + 1  # no zeros of their own
    out = cutout(images, torch.Generator().manual_seed(0))
    corners = set()
    for image, cut in zip(images, out):
        zeros = (cut[0] == 0).nonzero()
        (top, left), (bottom, right) = zeros.min(0).values.tolist(), zeros.max(0).values.tolist()
        assert len(zeros) == (bottom - top + 1) * (right - left + 1)  # one rectangle
        assert bottom - top + 1 <= 8 and right - left + 1 <= 8 and len(zeros) >= 4 * 4  # 8 x 8, clipped at edges
        assert torch.equal(cut[cut != 0], image[cut != 0])
        corners.add((top, left))
    assert len(corners) > 1


def test_the_augmentation_is_differentiable_and_none_draws_nothing():
    images = torch.randn(3, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    augment = Augment("color,translation,cutout")
    assert torch.autograd.gradcheck(lambda x: augment(x, torch.Generator().manual_seed(1)), images)
    draws = torch.Generator().manual_seed(1)
    state = draws.get_state()
    assert Augment("none")(images, draws) is images and torch.equal(draws.get_state(), state)


@pytest.mark.parametrize("policy", ["translation,cutout", "none"])
def test_the_discriminator_sees_augmented_real_and_generated_images_in_both_variants(tmp_path, monkeypatch, policy):
    """Every image D sees, real or generated, in D's and in G's step, carries a cutout square; none: none."""
    from gan.model import Discriminator
    seen = {"plain": [], "wrapped": []}

    def recording(variant):
        class RecordingDiscriminator(Discriminator):
            def forward(self, images):
                seen[variant].append(images.detach().clone())
                return super().forward(images)
        return RecordingDiscriminator

    monkeypatch.setattr(train_torch, "Discriminator", recording("plain"))
    monkeypatch.setattr(train, "Discriminator", recording("wrapped"))
    options = {**SMALL, "max_steps": 2, "augment": policy, "ema_decay": 0.0, "eval_samples": 8}
    train_torch.main(Config(**options, out=str(tmp_path / "plain")))
    train.main(Wrapped(**options, out=str(tmp_path / "wrapped"), accelerator="cpu"))
    assert len(seen["plain"]) == 2 * 3  # real, generated (D step), generated (G step)
    for a, b in zip(seen["plain"], seen["wrapped"]):
        assert torch.equal(a, b)
    zeros = torch.cat(seen["plain"]).eq(0).flatten(1).sum(1)  # exact zeros per image, of 32 x 32
    if policy == "none":
        assert zeros.max() < 8 * 8
    else:
        assert zeros.min() >= 8 * 8  # a 16 x 16 square, clipped to at least a quarter at a corner


# --- --native-size ------------------------------------------------------------------------------
def _enlarged_residual(images: torch.Tensor, native: int) -> float:
    """How far `images` (B, 1, S, S) lie from every bilinear enlargement of a native x native image: the
    largest least-squares residual against the S*S x native*native matrix of enlarged basis images."""
    size = images.shape[-1]
    basis = torch.eye(native * native, dtype=torch.float64).view(-1, 1, native, native)
    U = torch.nn.functional.interpolate(basis, size=size, mode="bilinear", align_corners=False).view(-1, size * size)
    flat = images.double().view(len(images), -1)
    coefficients = torch.linalg.lstsq(U.T, flat.T).solution
    return (U.T @ coefficients - flat.T).abs().max().item()


def test_native_size_draws_images_of_the_kind_the_digits_are():
    from gan.data import load_images
    from gan.model import Generator

    real = torch.stack([load_images("digits", None, 32)[i][0] for i in range(16)])
    assert _enlarged_residual(real, 8) < 1e-5  # the premise: the digits at 32 px are enlarged 8x8 scans
    noise = torch.randn(16, 16, 1, 1)
    for image_size in (32, 64):
        native = Generator(nz=16, ngf=8, image_size=image_size, native_size=8)(noise)
        assert native.shape == (16, 1, image_size, image_size) and native.abs().max() <= 1
        assert _enlarged_residual(native, 8) < 1e-5
    assert _enlarged_residual(Generator(nz=16, ngf=8, native_size=0)(noise), 8) > 0.1  # the paper's draws finer
    assert Config().generator_native_size() == 8 and Config(dataset="fake").generator_native_size() == 0
    assert Config(native_size="0").generator_native_size() == 0


def test_native_size_trains_alike_in_both_variants_and_changes_the_run(tmp_path):
    options = dict(SMALL, max_steps=4, ema_decay=0.0)
    train_torch.main(Config(**options, out=str(tmp_path / "plain")))  # digits: auto is 8
    train.main(Wrapped(**options, out=str(tmp_path / "wrapped"), accelerator="cpu"))
    train_torch.main(Config(**options, native_size="0", out=str(tmp_path / "paper")))
    plain = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)["generator"]
    paper = torch.load(tmp_path / "paper" / "checkpoints" / "last.ckpt", weights_only=True)["generator"]
    assert_close(plain, saved(tmp_path / "wrapped", "generator"), rtol=0, atol=0)
    assert not torch.equal(plain["main.0.weight"], paper["main.0.weight"])


@pytest.mark.slow  # four short runs, each with its final score
def test_a_run_from_before_native_size_resumes_with_the_paper_generator(tmp_path):
    options = dict(SMALL, max_steps=2, ema_decay=0.0)
    train_torch.main(Config(**options, native_size="0", out=str(tmp_path / "old")))
    config_json = tmp_path / "old" / "config.json"
    saved = json.loads(config_json.read_text())
    del saved["native_size"]  # the config.json of a run started before the flag existed
    config_json.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"native_size \(checkpoint '0', now '8'\)"):  # typed: refused
        resolved(Config, **dict(options, max_steps=3), native_size="8", resume=str(tmp_path / "old"))
    resumed = resolved(Config, max_steps=3, resume=str(tmp_path / "old"))  # not typed: the run's own, 0
    assert resumed.native_size == "0" and resumed.generator_native_size() == 0
    train_torch.main(resumed)

    train_torch.main(Config(**options, out=str(tmp_path / "auto")))  # auto and 8 stand for the same generator
    train_torch.main(resolved(Config, **dict(options, max_steps=3), native_size="8", resume=str(tmp_path / "auto")))
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["steps"] == 3
