"""core's contract against plain PyTorch, on generated programs (tests/contract): CI's budget of them, with each
cell's refusals bounded, and proof that the comparison sees bugs put into a copy of core. The long run a maintainer
makes before a release is in docs/core.md ("The contract, tested")."""
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from core import loaders, optimizers
from tests.conftest import ROOT, run
from tests.contract import ONE_PROCESS, TWO_PROCESSES, run_cells

# Each cell's refusals, at most, as a share of its programs: a program is drawn to be refused (tests/contract
# REFUSALS) only now and then, so that most programs run; the refusals-only cell is refused whole.
REFUSAL_BUDGET = {**{cell: 0.25 for cell in ONE_PROCESS + TWO_PROCESSES}, "fsdp:16-mixed": 1.0}


def assert_cells_hold(result: dict, report: str) -> None:
    assert result["failed"] == 0, report
    for cell, counts in result["cells"].items():
        programs = sum(counts[v] for v in ("ok", "refused", "failed"))
        assert counts["refused"] <= REFUSAL_BUDGET[cell] * programs, (cell, counts)


def test_generated_programs_on_one_process_match_plain_pytorch():
    report = io.StringIO()
    result = run_cells(ONE_PROCESS, seed=0, count=40, out=report)
    assert_cells_hold(result, report.getvalue())


@pytest.mark.multiprocess
def test_generated_programs_under_ddp_fsdp_and_deepspeed_match_plain_pytorch():
    result = run(["-m", "tests.contract", "--seed", "0", "--count", "4", "--devices", "2"], timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    report = result.stdout[result.stdout.index("{\n"):]
    assert_cells_hold(json.loads(report), result.stdout[-6000:])


# Bugs put into a copy of core, one at a time: (file, [(the code as it is, the code with the bug)], a cell that
# sees it[, the options of its run])
BUGS = {
    "a TypeError on a core line": ("core/fabric.py", [(
        "stack.enter_context(self._strategy.no_backward_sync(m))",
        "stack.enter_context(self._strategy.no_backward_sync(m, True))")], "single:32-true"),
    "frozen() thaws the layers its user froze": ("core/wrappers.py", [(
        "params = [p for m in modules for p in m.parameters() if p.requires_grad]",
        "params = [p for m in modules for p in m.parameters()]")], "single:32-true"),
    "a second optimizer's step on one backward refused": ("core/optimizers.py", [
        ("if backward.required and backward.count == self.seen:",
         "if backward.required and backward.count == backward.__dict__.get('stepped'):"),
        ("self.seen = backward.count\n", "self.seen = backward.stepped = backward.count\n")], "single:16-mixed"),
    "a copy of an optimizer steps the original": ("core/optimizers.py", [(
        'return share(self.__dict__, "strategy", "backward")',
        'return share(self.__dict__, "strategy", "backward", "optimizer")')], "single:32-true"),
    "a loss without model= goes to the first model": ("core/wrappers.py", [(
        "    if len(modules) == 1:\n        return modules[0]",
        "    if len(modules) >= 1:\n        return modules[0]")], "deepspeed_stage_2:32-true"),
    "a sharded checkpoint read whole keeps DCP's flattened names": ("core/checkpoint/sharded.py", [(
        "*parents, leaf = metadata.planner_data.get(key, (key,)) if metadata.planner_data else (key,)",
        "*parents, leaf = (key,)")], "fsdp:32-true", ["--seed", "5", "--count", "2", "--move-share", "1"]),  # moved to single, ddp
}


def core_with_a_bug(root, path: str, edits: list) -> None:
    """A copy of core and of the contract under `root`, with `edits` made to `path`."""
    shutil.copytree(ROOT / "core", root / "core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests" / "contract", root / "tests" / "contract",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "__init__.py").write_text("")
    source = (root / path).read_text()
    for code, broken in edits:
        assert source.count(code) == 1, f"{code!r} is no longer in {path} once: update the bug"
        source = source.replace(code, broken)
    (root / path).write_text(source)


def contract_in(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.contract", "--seed", "0", "--no-shrink", *args], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("bug", BUGS)
def test_the_generator_reports_a_bug_put_into_core_as_failed(tmp_path, bug):
    path, edits, cell, *options = BUGS[bug]
    core_with_a_bug(tmp_path, path, edits)
    distributed = not cell.startswith("single:")
    options = options[0] if options else ["--count", "10" if distributed else "20"]
    result = contract_in(tmp_path, "--cells", cell, *options, *(["--devices", "2"] if distributed else []))
    counts = json.loads(result.stdout[result.stdout.index("{\n"):])
    assert counts["failed"] >= 1 and result.returncode == 1, (bug, counts, result.stderr[-2000:])
    assert f"replay: python -m tests.contract --cells {cell}" in result.stdout


@pytest.mark.multiprocess
def test_a_program_that_hangs_a_rank_fails_within_its_bound_with_its_replay(tmp_path):
    """The program's Fabric(timeout=...) bounds its collectives inside the process group the run shares: rank 1
    never joins an all_reduce, and rank 0 stops after --timeout seconds, printing the program and its replay."""
    core_with_a_bug(tmp_path, "core/collectives.py", [("        op = validation.reduce_op(reduce_op)\n",
                                                  "        op = validation.reduce_op(reduce_op)\n"
                                                  "        if self.global_rank == 1:\n"
                                                  "            __import__('time').sleep(3600)\n")])
    result = contract_in(tmp_path, "--cells", "ddp:32-true", "--devices", "2", "--count", "20", "--timeout", "5",
                         "--move-share", "0")
    assert result.returncode != 0
    assert "HANG ddp:32-true program" in result.stderr and "rank 0 waited more than 5 s" in result.stderr, \
        result.stderr[-3000:]
    assert "replay: python -m tests.contract --cells ddp:32-true --devices 2 --seed 0 --index" in result.stderr


@pytest.mark.parametrize("break_core", ["zero_grad does nothing", "no set_epoch"])
def test_the_comparison_sees_a_broken_core(monkeypatch, break_core):
    if break_core == "zero_grad does nothing":
        monkeypatch.setattr(optimizers.FabricOptimizer, "zero_grad", lambda self, *args, **kwargs: None)
    else:
        monkeypatch.setattr(loaders, "epoch_samplers", lambda loader: [])
    report = io.StringIO()
    result = run_cells(["single:32-true"], seed=0, count=20, out=report)
    assert result["failed"] >= 1, result  # a BatchSampler's DistributedSampler over 2 epochs sees set_epoch
    assert "replay: python -m tests.contract --cells single:32-true --seed 0 --index" in report.getvalue()


def one_model(moved: str, **spec) -> dict:
    """A program of one model (SGD) and one step, whose final checkpoint a fresh process loads under `moved`."""
    model = {"width": 4, "split": False, "optimizers": [{"kind": "sgd", "params": "all", "scheduler": None}],
             "norm": False, "frozen": False, "marked": False, **spec}
    step = {"kind": "each", "clip": None, "lr_scale": None, "set_to_none": True, "overflow": False, "checkpoint": False,
            "reload_optimizer": False, "fresh": False, "no_model": False, "eval": False, "reduce": False, "copy": None}
    return {"models": [model], "loader": "shuffle", "epochs": 1, "steps": [step], "expect": None, "moved": moved}


# What loads in a fresh process found in core, each fixed: (the cell that saves, the program as shrunk)
FOUND = {
    # ZeRO-1 keeps the weights its user froze only in the module's state, which the conversion did not read; and
    # DeepSpeed's optimizer groups leave them out, which a torch optimizer over the whole model refused
    "a DeepSpeed checkpoint with a frozen layer, resumed on one device": (
        "deepspeed_stage_1:32-true", one_model("single:32-true", frozen=True)),
    # SGD without momentum: the conversion gave each weight an empty entry, which torch's fsdp loader cannot place
    "a DeepSpeed checkpoint of SGD without momentum, resumed under fsdp": (
        "deepspeed_stage_3:bf16-mixed", one_model("fsdp:bf16-mixed")),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("found", FOUND)
def test_a_load_in_a_fresh_process_that_failed_runs(found):
    cell, program = FOUND[found]
    result = run(["-m", "tests.contract", "--cells", cell, "--devices", "2", "--index", "0", "--no-shrink",
                  "--program", json.dumps(program)], timeout=600, check=False)
    counts = json.loads(result.stdout[result.stdout.index("{\n"):])
    assert result.returncode == 0 and counts["moved to"] == {program["moved"]: 1}, result.stdout[-3000:]
