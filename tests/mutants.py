"""Does the suite catch the bugs it should? Each mutant is one realistic one-line bug in core; this puts each into
a copy of the committed tree, runs the suite there until its first failure, and reports which test caught it.

    python -m tests.mutants --list                             # the mutants
    python -m tests.mutants --out runs/mutants.json            # every mutant, against HEAD
    python -m tests.mutants --only mean_not_divided --commit HEAD~3

A mutant is caught when the suite fails on it. The quick subset runs first and the slow tests only where it
passes, each with -x, so a caught mutant costs its first failure, not a whole run; one the suite misses costs a
whole run. The working tree is never touched: the copy is a clone of the commit.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (file, the line as it is, the line as the bug writes it, what a user would see)
MUTANTS = {
    "wrong_reduce_op": (
        "core/strategies/ddp.py",
        'dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "mean" else op, group=group)',
        'dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "mean" else op, group=group)',
        "fabric.all_reduce(x) (mean) takes the largest rank's value"),
    "mean_not_divided": (
        "core/strategies/ddp.py",
        'return tensor / dist.get_world_size(group) if op == "mean" else tensor',
        "return tensor",
        "a mean over ranks is their sum"),
    "lost_scaler_update": (
        "core/precision/base.py",
        "        self._update_due = True\n        return result",
        "        return result",
        "16-mixed never lowers its loss scale after an overflow"),
    "clip_not_unscaled": (
        "core/strategies/single.py",
        "        self.precision.unscale_gradients(optimizer)\n        params = [p for group in optimizer.param_groups "
        "for p in group[\"params\"]]\n",
        "        params = [p for group in optimizer.param_groups for p in group[\"params\"]]\n",
        "16-mixed clips the scaled gradients (by norm)"),
    "sync_left_off_after_no_sync": (
        "core/strategies/fsdp.py",
        "            module.module.set_requires_gradient_sync(True)",
        "            module.module.set_requires_gradient_sync(enabled)",
        "under fsdp, the micro-batch after no_backward_sync skips its gradient sync"),
    "frozen_layer_thawed": (
        "core/wrappers.py",
        "params = [p for m in modules for p in m.parameters() if p.requires_grad]",
        "params = [p for m in modules for p in m.parameters()]",
        "fabric.frozen thaws a layer the user froze"),
    "scaler_state_dropped": (
        "core/state.py",
        '"scaler": strategy.precision.state_dict(value.optimizer)}',
        '"scaler": None}',
        "a checkpoint loses the loss scale"),
    "plain_value_not_restored": (
        "core/state.py",
        "                state[key] = saved[key]",
        "                pass",
        "fabric.load leaves the step counter (and every plain value) as it was"),
    "unwrapped_under_ddp": (
        "core/strategies/ddp.py",
        "if not any(p.requires_grad for p in module.parameters()):",
        "if any(p.requires_grad for p in module.parameters()):",
        "ddp leaves trainable models unwrapped: no gradient sync"),
    "sampler_epoch_not_set": (
        "core/loaders.py",
        "                sampler.set_epoch(epoch)",
        "                pass",
        "every epoch reads the same shuffled order"),
    "deepspeed_clips_by_default": (
        "core/strategies/deepspeed.py",
        'config.setdefault("gradient_clipping", 0.0)',
        'config.setdefault("gradient_clipping", 1.0)',
        "DeepSpeed clips every gradient to norm 1 unasked"),
    "fsdp_clip_uses_local_norm": (
        "core/strategies/fsdp.py",
        "grads = [p.grad for p in params if p.grad is not None]",
        "grads = [p.grad.to_local() for p in params if p.grad is not None]",
        "fsdp's clip_gradients clips by the norm of this rank's shards"),
}


def mutate(tree: Path, name: str) -> None:
    file, before, after, _ = MUTANTS[name]
    path = tree / file
    text = path.read_text()
    if text.count(before) != 1:
        raise SystemExit(f"mutant {name}: {file} holds {text.count(before)} copies of the line it changes (needs 1): "
                         "update MUTANTS to the code as it is now")
    path.write_text(text.replace(before, after))


def export(commit: str, into: Path) -> None:
    """A clone of `commit` (a repository, since some tests read the commit they run at)."""
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(into)], check=True)
    subprocess.run(["git", "checkout", "-q", commit], cwd=into, check=True)


def first_failure(tree: Path, pytest_args: list[str], log) -> tuple[str | None, float]:
    """Run the quick subset, then the slow tests, each stopping at its first failure: the failing test's id (None:
    the suite passed) and the seconds it took."""
    start = time.monotonic()
    for subset in ("not slow", "slow"):
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", subset,
                                 "-o", "addopts=-n 2 --dist worksteal", "-rf", *pytest_args], cwd=tree,
                                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
        log.write(result.stdout[-20000:] + result.stderr[-5000:])
        failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        if failed or result.returncode == 1:  # xdist's -x ends a run that failed as interrupted (exit 2)
            return (failed[0] if failed else "(failed, unnamed)"), time.monotonic() - start
        if result.returncode not in (0, 5):
            return f"(pytest exited {result.returncode})", time.monotonic() - start
    return None, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--commit", default="HEAD", help="the commit whose suite is tried (default HEAD)")
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.list:
        for name, (file, _, _, effect) in MUTANTS.items():
            print(f"{name:30} {file:30} {effect}")
        return 0
    names = [n for n in args.only.split(",") if n] or list(MUTANTS)
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown:
        parser.error(f"unknown mutants {unknown}; --list shows them")
    commit = subprocess.run(["git", "rev-parse", args.commit], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode != 0:
        parser.error(f"--commit {args.commit} is not a commit here")
    results = {"commit": commit.stdout.strip(), "mutants": {}}
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as parent:
            tree = Path(parent) / "tree"
            export(results["commit"], tree)
            mutate(tree, name)
            with open(Path(tempfile.gettempdir()) / f"mutant-{name}.log", "w") as log:
                caught_by, seconds = first_failure(tree, args.pytest_args, log)
        results["mutants"][name] = {"caught_by": caught_by, "seconds": round(seconds, 1)}
        print(f"{name:30} {'caught by ' + caught_by if caught_by else 'MISSED'} ({seconds:.0f} s)", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    missed = [n for n, r in results["mutants"].items() if r["caught_by"] is None]
    print(f"{len(names) - len(missed)} of {len(names)} caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
