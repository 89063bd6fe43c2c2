"""The workloads, one entry each: the settings the benchmarks and the tests run them with.

Each field serves one purpose and keeps the values it was measured with, so results stay comparable
across commits; benchmarks/README.md says what each field means and how to add a workload. Settings
are config fields (`{"batch_size": 8}`); `flags()` turns them into the command line (`--batch-size 8`).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Quality:
    """A target for the default command's final score (`summary.json`), with the figure it was set from."""
    metric: str
    target: str  # "<= 4.5" or ">= 2.2"
    reference: str


@dataclass(frozen=True)
class Workload:
    name: str  # the package: `python -m <name>.train_torch` and `python -m <name>.train`
    losses: tuple[str, ...]  # keys of metrics.jsonl plotted as loss curves (benchmarks/compare.py)
    small: dict  # a model small enough that a test run takes seconds (tests, with their own steps)
    generated_data: dict  # data the tests generate instead of reading: no files, no download
    crash_steps: tuple[int, int]  # (steps, log every) of tests/test_reliability.py: a kill lands mid-run
    parity: dict  # tiny but real settings of benchmarks/parity.py
    parity_steps: tuple[int, int]  # (steps, log every) of a --quick parity run; a full run doubles the steps
    compare_steps: int  # default --max-steps of benchmarks/compare.py
    gpu: dict  # benchmarks/gpu_check.py's run, steps included
    quality: tuple[Quality, ...]  # benchmarks/run.py, full mode: targets for `python -m <name>.train`
    deepspeed: bool = True  # False: the workload refuses the deepspeed* strategies (its README says why)


WORKLOADS = {workload.name: workload for workload in [
    Workload(
        name="gan",
        losses=("loss_d", "loss_g"),
        small={"batch_size": 8, "ngf": 8, "ndf": 8, "nz": 16, "eval_samples": 8},
        generated_data={"dataset": "fake"},
        crash_steps=(200, 10),
        parity={"dataset": "fake", "batch_size": 64, "sample_every": 1000000, "eval_samples": 64},
        parity_steps=(80, 10),
        compare_steps=600,
        gpu={"dataset": "fake", "batch_size": 128, "max_steps": 60, "log_every": 10, "sample_every": 1000000,
             "eval_samples": 64},
        quality=(Quality("fid_classifier", "<= 0.9", "1.117, 3 seeds, the paper's generator "
                                                     "(--native-size 0, commit 1b8dc7f); real floor ~0.44"),
                 Quality("class_entropy", ">= 2.2", "of 2.303")),
    ),
    Workload(
        name="autoencoder",
        losses=("loss",),
        small={"batch_size": 8, "width": 4},
        generated_data={"dataset": "fake"},
        crash_steps=(300, 10),
        parity={"dataset": "fake", "batch_size": 64},
        parity_steps=(160, 20),
        compare_steps=600,
        gpu={"dataset": "fake", "batch_size": 128, "max_steps": 60, "log_every": 10},
        quality=(Quality("test_psnr", ">= 34", "33.12 at 1,200 steps, seeds 0-2 (commit ead227d)"),),
    ),
    Workload(
        name="metalearn",
        losses=("loss",),
        small={"hidden": 16, "eval_tasks": 10},
        generated_data={},  # the default task family, sinusoid, is generated
        crash_steps=(600, 50),
        parity={"eval_tasks": 100},
        parity_steps=(600, 100),
        compare_steps=3000,
        gpu={"max_steps": 200, "log_every": 20, "eval_tasks": 100},
        quality=(Quality("test_mse_steps", "<= 0.38", "0.364, seeds 0-2, by hand when it became the default"),),
        # the MSE after 1 step
        deepspeed=False,
    ),
]}


def flags(settings: dict) -> list[str]:
    """Config fields as command-line flags: {"batch_size": 8} -> ["--batch-size", "8"]."""
    return [item for key, value in settings.items() for item in ("--" + key.replace("_", "-"), str(value))]
