"""MAML: the batched meta-gradient (all tasks at once) against a per-task loop and finite differences, first-order MAML,
Meta-SGD, DDP against one process, and the task samplers."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from core.checkpoint import load_checkpoint, read
from metalearn.config import Config
from metalearn.data import Classes, Sinusoid, make_tasks
from metalearn.maml import MetaLearner
from metalearn.model import MLP
from metalearn.report import evaluate
from tests.conftest import HANG, run


def tiny_batch(tasks=3, seed=0):
    return Sinusoid().sample(tasks, 5, 5, torch.Generator().manual_seed(seed))


def loop_meta_gradient(model, batch, inner_lr, steps, first_order=False):
    """The textbook per-task loop with autograd.grad(create_graph=True)."""
    params = list(model.parameters())
    total = 0
    for sx, sy, qx, qy in zip(*batch):
        fast = params
        for _ in range(steps):
            loss = F.mse_loss(torch.func.functional_call(model, dict(zip(dict(model.named_parameters()), fast)),
                                                         (sx,)), sy)
            grads = torch.autograd.grad(loss, fast, create_graph=not first_order)
            fast = [p - inner_lr * g for p, g in zip(fast, grads)]
        names = dict(model.named_parameters())
        total = total + F.mse_loss(torch.func.functional_call(model, dict(zip(names, fast)), (qx,)), qy)
    return torch.autograd.grad(total / len(batch[0]), params)


def batched_meta_gradient(learner, batch):
    learner.zero_grad()
    learner(*batch).mean().backward()
    return [p.grad.clone() for p in learner.model.parameters()]


@pytest.mark.parametrize("steps", [1, 2])
def test_batched_meta_gradient_equals_the_per_task_loop(steps):
    torch.manual_seed(0)
    model = MLP(1, 8, 1).double()
    batch = tuple(t.double() for t in tiny_batch())
    learner = MetaLearner(model, F.mse_loss, inner_lr=0.05, inner_steps=steps)
    for a, b in zip(batched_meta_gradient(learner, batch), loop_meta_gradient(model, batch, 0.05, steps)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_evaluation_adapts_each_task_as_a_per_task_loop_does():
    torch.manual_seed(0)
    model = MLP(1, 8, 1).double()
    batch = tuple(t.double() for t in tiny_batch())
    learner = MetaLearner(model, F.mse_loss, inner_lr=0.05)
    predictions, losses = learner.evaluate(*batch, steps=2)
    names = [n for n, _ in model.named_parameters()]
    for t, (sx, sy, qx, qy) in enumerate(zip(*batch)):
        fast = [p.detach().requires_grad_() for p in model.parameters()]
        for _ in range(2):
            loss = F.mse_loss(torch.func.functional_call(model, dict(zip(names, fast)), (sx,)), sy)
            fast = [(p - 0.05 * g).detach().requires_grad_() for p, g in zip(fast, torch.autograd.grad(loss, fast))]
        expected = torch.func.functional_call(model, dict(zip(names, fast)), (qx,))
        torch.testing.assert_close(predictions[t], expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(losses[t], F.mse_loss(expected, qy), rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())  # evaluation leaves the weights' gradients alone


def test_meta_gradient_equals_finite_differences():
    torch.manual_seed(0)
    model = MLP(1, 4, 1, layers=1).double()
    batch = tuple(t.double() for t in tiny_batch(2))
    learner = MetaLearner(model, F.mse_loss, inner_lr=0.1, inner_steps=2)
    analytic = torch.cat([g.flatten() for g in batched_meta_gradient(learner, batch)])
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    numeric = torch.zeros_like(flat)
    eps = 1e-6
    with torch.no_grad():
        for i in range(len(flat)):
            values = []
            for sign in (1, -1):
                shifted = flat.clone()
                shifted[i] += sign * eps
                torch.nn.utils.vector_to_parameters(shifted, model.parameters())
                with torch.enable_grad():
                    values.append(learner(*batch).mean().item())
            numeric[i] = (values[0] - values[1]) / (2 * eps)
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
    torch.testing.assert_close(analytic, numeric, rtol=1e-5, atol=1e-7)


def test_first_order_is_the_query_gradient_at_the_adapted_weights():
    torch.manual_seed(0)
    model = MLP(1, 8, 1).double()
    batch = tuple(t.double() for t in tiny_batch())
    learner = MetaLearner(model, F.mse_loss, inner_lr=0.05, inner_steps=1, first_order=True)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for sx, sy, qx, qy in zip(*batch):
        adapted = [p.detach() - 0.05 * g for p, g in zip(
            model.parameters(), torch.autograd.grad(F.mse_loss(model(sx), sy), list(model.parameters())))]
        adapted = [p.requires_grad_() for p in adapted]
        names = [n for n, _ in model.named_parameters()]
        loss = F.mse_loss(torch.func.functional_call(model, dict(zip(names, adapted)), (qx,)), qy)
        for e, g in zip(expected, torch.autograd.grad(loss, adapted)):
            e += g / len(batch[0])
    for a, b in zip(batched_meta_gradient(learner, batch), expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_meta_sgd_learns_one_step_size_per_weight():
    learner = MetaLearner(MLP(1, 8, 1), F.mse_loss, inner_lr=0.01, learn_inner_lr=True)
    learner(*tiny_batch()).mean().backward()
    assert len(learner.inner_lrs) == 6
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.inner_lrs.values())


def test_evaluation_improves_with_inner_steps_on_a_trained_init():
    torch.manual_seed(0)
    learner = MetaLearner(MLP(1, 40, 1), F.mse_loss, inner_lr=0.01)
    optimizer = torch.optim.Adam(learner.parameters(), lr=1e-3)
    for step in range(300):
        loss = learner(*Sinusoid().sample(10, 10, 10, torch.Generator().manual_seed(step))).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    batch = Sinusoid().sample(50, 10, 50, torch.Generator().manual_seed(10_000))
    before = learner.evaluate(*batch, steps=0)[1].mean()
    after = learner.evaluate(*batch, steps=5)[1].mean()
    assert after < before


def test_held_out_tasks_do_not_depend_on_the_training_seed_and_divergence_is_reported():
    torch.manual_seed(0)
    learner = MetaLearner(MLP(1, 8, 1), F.mse_loss, inner_lr=0.01)
    seen = []

    def evaluate_fn(support_x, support_y, query_x, query_y, steps):
        seen.append(support_x)
        return learner.evaluate(support_x, support_y, query_x, query_y, steps)

    def config(seed):
        return Config(seed=seed, eval_tasks=50, eval_queries=20)

    evaluate(evaluate_fn, Sinusoid(), config(0), torch.device("cpu"))
    evaluate(evaluate_fn, Sinusoid(), config(1), torch.device("cpu"))
    assert torch.equal(seen[0], seen[-1])  # the same 50 tasks, so two runs compare task by task

    learner.inner_lr = 1e4  # steps this large blow the weights up to inf/nan
    results = evaluate(evaluate_fn, Sinusoid(), config(0), torch.device("cpu"))
    assert results["diverged"][0] == 0 and results["mse"][0] is not None
    assert results["diverged"][10] > 0 and results["mse"][10] is None and results["ci95"][10] is None


def test_sinusoid_tasks_follow_the_paper():
    sx, sy, qx, qy = Sinusoid().sample(500, 10, 5, torch.Generator().manual_seed(0))
    assert sx.shape == (500, 10, 1) and qy.shape == (500, 5, 1)
    assert sx.min() >= -5 and sx.max() <= 5
    assert sy.abs().max() <= 5


def test_digits_tasks_are_n_way_k_shot_with_unseen_test_classes():
    tasks = make_tasks("digits", ways=5, train=True)
    sx, sy, qx, qy = tasks.sample(4, 3, 2, torch.Generator().manual_seed(0))
    assert sx.shape == (4, 15, 64) and qx.shape == (4, 10, 64)
    assert torch.equal(sy[0].sort().values, torch.arange(5).repeat_interleave(3))
    test = make_tasks("digits", ways=5, train=False)
    assert not torch.equal(tasks.images[0, 0], test.images[0, 0])
    # classes 0-4, each also rotated by 90, 180 and 270 degrees as a class of its own: 20 classes
    assert tasks.images.shape[0] == 20 and torch.equal(tasks.images[5], tasks.images[0].rot90(1, (1, 2)))
    with pytest.raises(ValueError, match="need 21 classes"):
        make_tasks("digits", ways=21, train=True)


def test_omniglot_from_a_generated_folder(tmp_path, monkeypatch):
    # torchvision checks the md5 of the release's zip files, which generated files cannot match
    monkeypatch.setattr("torchvision.datasets.omniglot.check_integrity", lambda *args, **kwargs: True)
    for alphabet in ("Greek", "Latin"):
        for character in ("character01", "character02", "character03"):
            folder = tmp_path / "omniglot-py" / "images_background" / alphabet / character
            folder.mkdir(parents=True)
            for i in range(4):
                Image.fromarray(np.full((105, 105), 255 if i % 2 else 0, dtype=np.uint8)).save(folder / f"{i}.png")
    tasks = make_tasks("omniglot", ways=5, train=True, root=str(tmp_path))
    assert isinstance(tasks, Classes) and tasks.images.shape == (24, 4, 28, 28)
    sx, sy, qx, qy = tasks.sample(2, 1, 3, torch.Generator().manual_seed(0))
    assert sx.shape == (2, 5, 784) and qx.shape == (2, 15, 784)
    with pytest.raises(ValueError, match="sum to at most 4"):  # 20 drawings per character in the release
        tasks.sample(2, 1, 10, torch.Generator().manual_seed(0))
    with pytest.raises(FileNotFoundError, match="omniglot-py/images_background"):
        make_tasks("omniglot", ways=5, train=True, root=str(tmp_path / "missing"))


def test_classification_run_reports_accuracy(tmp_path):
    result = run(["-m", "metalearn.train", "--dataset", "digits", "--max-steps", "20", "--batch-size", "4",
                  "--shots", "1", "--queries", "5", "--eval-tasks", "20", "--out", str(tmp_path)])
    assert "test accuracy after 1 step 0." in result.stdout
    import json
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 <= summary["test_accuracy"] <= 1 and summary["test_accuracy_ci95"] >= 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_fsdp_and_zero2_meta_gradients_equal_one_process_on_the_whole_meta_batch(tmp_path):
    """25 tasks split 13 + 12 across two processes: the scaled sum keeps the gradient exact. ZeRO-2's gradient
    hooks sit on the weights themselves, which the inner gradients (of each task's copy) never reach."""
    common = ["-m", "metalearn.train", "--max-steps", "5", "--eval-tasks", "10", "--hidden", "16"]
    run([*common, "--out", str(tmp_path / "one")])
    one = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.ckpt")["learner"]
    for strategy in ("ddp", "fsdp", "deepspeed_stage_2"):
        run([*common, "--strategy", strategy, "--accelerator", "cpu", "--devices", "2",
             "--out", str(tmp_path / strategy)])
        two = read(tmp_path / strategy / "checkpoints" / "last.ckpt")["learner"]  # fsdp, deepspeed: directories
        assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6, strategy


def test_zero3_is_refused_with_the_reason(tmp_path):
    result = run(["-m", "metalearn.train", "--strategy", "deepspeed_stage_3", "--max-steps", "2",
                  "--out", str(tmp_path)], check=False, timeout=HANG)
    assert result.returncode == 2, result.stderr
    assert "--strategy deepspeed_stage_3 cannot run this workload, which needs a set-up model's parameters read " \
        "as whole tensors" in result.stderr and "ZeRO-3 holds each parameter as an empty placeholder" in result.stderr \
        and "use deepspeed_stage_1 or deepspeed_stage_2, ddp or fsdp" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "config.json").exists()
