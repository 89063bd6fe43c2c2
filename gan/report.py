"""What a GAN run leaves behind: sample grids, the score, the summary and the loss plot."""
import dataclasses
import time
from contextlib import nullcontext

import torch

from gan.data import load_images
from gan.score import Scorer


def save_samples(run, images: torch.Tensor, step: int) -> None:
    if run.write:
        from torchvision.utils import save_image  # here: torchvision takes seconds to import, and only rank 0 writes
        (run.path / "samples").mkdir(exist_ok=True)
        save_image(images.float().cpu(), run.path / "samples" / f"step_{step:06d}.png", nrow=8, normalize=True,
                   value_range=(-1, 1))


@torch.no_grad()
def generate(generator, noise: torch.Tensor, ema=None) -> torch.Tensor:
    """Images from `noise` in eval mode (BatchNorm's running statistics), with `ema`'s average weights swapped
    in when given. Every process must call it: under fsdp and deepspeed the generator's forward is collective."""
    generator.eval()
    with torch.no_grad(), ema.swapped_in() if ema is not None else nullcontext():
        images = generator(noise)
    generator.train()
    return images


_scorers = {}  # (dataset, data root, image size) -> its Scorer, built at a run's first score


def _score(config, generated: torch.Tensor, quick: bool = False) -> dict:
    key = (config.dataset, config.data_root, config.image_size)
    if key not in _scorers:
        train_set = load_images(config.dataset, config.data_root, config.image_size)
        test_set = load_images(config.dataset, config.data_root, config.image_size, train=False)
        _scorers[key] = Scorer(train_set, test_set, config.dataset, config.image_size)
    scorer = _scorers[key]
    return scorer.quick(generated.float().cpu()) if quick else scorer.score(generated.float().cpu())


def evaluate(run, config, generated: torch.Tensor, step: int) -> float | None:
    """During training: score `generated` on rank 0 and log it; its FID there, None on the other ranks."""
    if not run.write:
        return None
    started = time.perf_counter()  # the first builds the run's Scorer; the ranks wait for rank 0 meanwhile
    metrics = _score(config, generated, quick=True)
    run.log({"step": step, "eval_fid_classifier": metrics["fid_classifier"],
             "eval_class_entropy": metrics["class_entropy"], "eval_seconds": round(time.perf_counter() - started, 4)})
    return metrics["fid_classifier"]


def finish(run, config, generated: torch.Tensor, started: float, steps: int, raw: torch.Tensor | None = None,
           best: dict | None = None) -> dict:
    """Score the generated images against the real ones and write summary.json (rank 0 only). `generated`
    comes from the EMA generator when there is one, and `raw` from the raw generator, scored as raw_*; `best`:
    the best evaluation during training ({"best_step": ..., "best_fid_classifier": ...})."""
    if not run.write:
        return {}
    if config.dataset == "fake":  # noise has no classes to score against
        metrics = {}
    else:
        metrics = _score(config, generated)
        if raw is not None:
            raw_metrics = _score(config, raw)
            metrics.update(raw_fid_classifier=raw_metrics["fid_classifier"],
                           raw_class_entropy=raw_metrics["class_entropy"])
    summary = {**metrics, **(best or {}), "steps": steps, "train_seconds": round(time.time() - started, 1),
               **run.resources(), "config": dataclasses.asdict(config)}
    run.write_json("summary.json", summary)
    run.plot_losses(["loss_d", "loss_g"])
    if metrics:
        quality = (f"classifier FID: {summary['fid_classifier']:.2f} (real floor {summary['fid_real_floor']:.2f}, "
                   f"noise {summary['fid_noise']:.1f})  class entropy: {summary['class_entropy']:.3f} of 2.303")
        if raw is not None:
            quality = (f"EMA generator {quality}; raw generator FID {summary['raw_fid_classifier']:.2f}, "
                       f"class entropy {summary['raw_class_entropy']:.3f}")
    else:
        quality = "not scored: fake data has no classes to score against"
    print(f"Run directory: {run.path}  samples: {run.path / 'samples'}  {quality}")
    return summary
