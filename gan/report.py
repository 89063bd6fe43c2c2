"""What a GAN run leaves behind: sample grids, the score, the summary and the loss plot."""
import dataclasses
import time

import torch
from torchvision.utils import save_image

from gan.data import load_images
from gan.score import score


def save_samples(run, images: torch.Tensor, step: int) -> None:
    if run.write:
        (run.path / "samples").mkdir(exist_ok=True)
        save_image(images.float().cpu(), run.path / "samples" / f"step_{step:06d}.png", nrow=8, normalize=True,
                   value_range=(-1, 1))


def finish(run, config, generated: torch.Tensor, started: float, steps: int) -> dict:
    """Score the generated images against the real ones and write summary.json (rank 0 only)."""
    if not run.write:
        return {}
    if config.dataset == "fake":  # noise has no classes to score against
        metrics = {}
    else:
        train_set = load_images(config.dataset, config.data_root, config.image_size)
        test_set = load_images(config.dataset, config.data_root, config.image_size, train=False)
        metrics = score(generated.float().cpu(), train_set, test_set, config.dataset, config.image_size)
    summary = {**metrics, "steps": steps, "train_seconds": round(time.time() - started, 1), **run.resources(),
               "config": dataclasses.asdict(config)}
    run.write_json("summary.json", summary)
    run.plot_losses(["loss_d", "loss_g"])
    if metrics:
        quality = (f"classifier FID: {summary['fid_classifier']:.2f} (real floor {summary['fid_real_floor']:.2f}, "
                   f"noise {summary['fid_noise']:.1f})  class entropy: {summary['class_entropy']:.3f} of 2.303")
    else:
        quality = "not scored: fake data has no classes to score against"
    print(f"Run directory: {run.path}  samples: {run.path / 'samples'}  {quality}")
    return summary
