"""MAML's evaluation like the paper's: held-out tasks, error after 0, 1, 5 and 10 inner steps."""
import dataclasses
import math
import time

import torch
import torch.nn.functional as F

EVAL_STEPS = (0, 1, 5, 10)
EVAL_SEED = 2026  # the held-out tasks are the same for every run, whatever its --seed: runs compare task by task


def loss_function(dataset: str):
    return F.mse_loss if dataset == "sinusoid" else F.cross_entropy


def _mean_ci(values: torch.Tensor) -> tuple[float | None, float | None]:
    """Mean and 95% interval; None (null in summary.json) when an adaptation diverged to inf or nan."""
    values = values.double()
    if not values.isfinite().all():
        return None, None
    return values.mean().item(), 1.96 * values.std().item() / math.sqrt(len(values))


@torch.no_grad()
def evaluate(evaluate_fn, tasks, config, device) -> dict:
    """`evaluate_fn(sx, sy, qx, qy, steps)` is the learner's evaluate method; every process calls this."""
    queries = config.eval_queries if config.dataset == "sinusoid" else \
        min(config.eval_queries, tasks.images.shape[1] - config.shots)  # classes hold few examples
    batch = tasks.sample(config.eval_tasks, config.shots, queries, torch.Generator().manual_seed(EVAL_SEED))
    support_x, support_y, query_x, query_y = (t.to(device) for t in batch)
    key = "mse" if config.dataset == "sinusoid" else "accuracy"
    results = {key: {}, "median": {}, "ci95": {}, "curves": {}, "diverged": {}}
    for steps in EVAL_STEPS:
        predictions, losses = evaluate_fn(support_x, support_y, query_x, query_y, steps)
        if config.dataset == "sinusoid":
            values = losses.float().cpu()
            results["curves"][steps] = predictions[:3].float().cpu()
        else:
            values = (predictions.argmax(-1) == query_y).float().mean(-1).cpu()
        mean, ci = _mean_ci(values)
        results[key][steps], results["ci95"][steps], results["median"][steps] = mean, ci, \
            values.nan_to_num(nan=math.inf).median().item()  # a diverged task ranks last
        results["diverged"][steps] = int((~values.isfinite()).sum())
    results["tasks"] = (support_x[:3].cpu(), support_y[:3].cpu(), query_x[:3].cpu(), query_y[:3].cpu())
    return results


def _plot_curves(run, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    support_x, support_y, query_x, query_y = results["tasks"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for task, ax in enumerate(axes):
        order = query_x[task, :, 0].argsort()
        ax.plot(query_x[task, order, 0], query_y[task, order, 0], "k-", label="true")
        for steps in (0, 1, 10):
            ax.plot(query_x[task, order, 0], results["curves"][steps][task, order, 0],
                    label=f"{steps} step{'' if steps == 1 else 's'}")
        ax.plot(support_x[task, :, 0], support_y[task, :, 0], "k^", label="support")
        ax.set_title(f"test task {task}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run.path / "adaptation.png", dpi=100)
    plt.close(fig)


def finish(run, config, results: dict, started: float, steps: int) -> dict:
    if not run.write:
        return {}
    summary = {"steps": steps, "train_seconds": round(time.time() - started, 1), **run.resources()}
    if config.dataset == "sinusoid":
        summary.update(test_mse_steps=results["mse"], test_mse_ci95_steps=results["ci95"],
                       test_mse_median_steps=results["median"], test_diverged_tasks_steps=results["diverged"])
        _plot_curves(run, results)
        line = ", ".join(f"{k} step{'' if k == 1 else 's'} " + (f"{v:.3f}" if v is not None else
                                          f"n/a ({results['diverged'][k]} tasks diverged; median "
                                          f"{results['median'][k]:.3f})") for k, v in results["mse"].items())
        print(f"Run directory: {run.path}  test MSE after {line}")
    else:
        step = config.inner_steps if config.inner_steps in EVAL_STEPS else 10
        summary.update(test_accuracy=results["accuracy"][step], test_accuracy_ci95=results["ci95"][step],
                       test_accuracy_steps=results["accuracy"], test_accuracy_ci95_steps=results["ci95"])
        print(f"Run directory: {run.path}  test accuracy after {step} step{'' if step == 1 else 's'} "
              f"{results['accuracy'][step]:.3f} +- {results['ci95'][step]:.3f}")
    summary["config"] = dataclasses.asdict(config)
    run.write_json("summary.json", summary)
    run.plot_losses(["loss"])
    return summary
