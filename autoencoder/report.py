"""What an autoencoder run leaves behind: test error and PSNR, reconstructions, the code scatter."""
import dataclasses
import math
import time

import torch
import torch.nn.functional as F


def psnr(mse_pm1: float) -> float:
    """PSNR in dB of images in [0, 1], from a mean squared error measured on [-1, 1] images (4x larger)."""
    return 10 * math.log10(1.0 / (mse_pm1 / 4)) if mse_pm1 > 0 else float("inf")


@torch.no_grad()
def evaluate(model, test_set, train_set, device) -> dict:
    """Reconstruction error on the whole test split, against predicting the mean training image; the
    test codes. Every process must call it when the model is sharded."""
    images = torch.stack([image for image, _ in test_set]).to(device)
    reconstructions = torch.cat([model(chunk) for chunk in images.split(256)])
    codes = torch.cat([model.encode(chunk) for chunk in images.split(256)])
    mean_image = torch.stack([image for image, _ in train_set]).mean(0)
    mse = F.mse_loss(reconstructions.float(), images.float()).item()
    baseline = F.mse_loss(mean_image.expand_as(images.cpu()), images.float().cpu()).item()
    return {"test_mse": mse, "test_psnr": psnr(mse), "baseline_psnr": psnr(baseline),
            "images": images[:16].cpu(), "reconstructions": reconstructions[:16].cpu(), "codes": codes.float().cpu(),
            "labels": torch.tensor([int(label) for _, label in test_set])}


def finish(run, config, results: dict, started: float, steps: int) -> dict:
    """Write reconstructions.png, codes.png (2-D latents), the loss plot and summary.json (rank 0 only)."""
    if not run.write:
        return {}
    from torchvision.utils import save_image  # here: torchvision takes seconds to import, and only rank 0 writes
    codes, labels = results.pop("codes"), results.pop("labels")
    grid = torch.cat([results.pop("images"), results.pop("reconstructions").float()])  # inputs above outputs
    save_image(grid, run.path / "reconstructions.png", nrow=16, normalize=True, value_range=(-1, 1))
    if codes.shape[1] == 2:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5))
        points = ax.scatter(codes[:, 0], codes[:, 1], c=labels, cmap="tab10", s=6)
        fig.colorbar(points, ax=ax, label="class")
        ax.set_title("test codes")
        fig.savefig(run.path / "codes.png", dpi=100)
        plt.close(fig)
    summary = {**results, "steps": steps, "train_seconds": round(time.time() - started, 1), **run.resources(),
               "config": dataclasses.asdict(config)}
    run.write_json("summary.json", summary)
    run.plot_losses(["loss"])
    print(f"Run directory: {run.path}  test PSNR: {summary['test_psnr']:.2f} dB "
          f"(mean-image baseline {summary['baseline_psnr']:.2f} dB)")
    return summary
