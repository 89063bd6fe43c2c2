"""Running programs: each through core and as plain PyTorch, one verdict per program agreed by every rank, a
failing program shrunk to a small one, and the command line (`python -m tests.contract`)."""
import argparse
import json
import logging
import random
import os
import re
import subprocess
import sys
import tempfile
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from tests.contract.compare import differences, moments
from tests.contract.plain import run_plain
from tests.contract.programs import (MOVE_SHARE, ONE_PROCESS, REFUSALS, TWO_PROCESSES, draw, expected_refusal, fits,
                                     script)
from tests.contract.shrink import simpler
from tests.contract.through_core import run_core

SHRINK_TRIES = 80  # programs run while shrinking a failure, at most
# what core's launcher sets for the ranks it starts: the fresh processes of a moved program start their own
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check(program: dict, strategy: str, precision: str, seed: int, timeout: float = 120.0) -> tuple[str, str]:
    """("ok" | "refused" | "failed", detail) for one program, agreed by every rank; `timeout`: seconds a collective
    may wait (a TimeoutError past it)."""
    with tempfile.TemporaryDirectory() as tmp:
        verdict = check_in(program, strategy, precision, seed, Path(tmp), timeout)
        if strategy == "single":
            return verdict
        import torch.distributed as dist
        verdicts = [None] * dist.get_world_size()
        try:  # also: rank 0's folder is removed only when every rank is done
            dist.all_gather_object(verdicts, verdict)
        except RuntimeError as error:  # gloo's time-out: another rank is still inside the program
            if "Timed out" not in str(error):
                raise
            raise TimeoutError(f"rank {dist.get_rank()} waited more than {timeout:g} s for the other ranks to end "
                               f"the program; its own verdict: {verdict[0]} {verdict[1]}".strip()) from error
        failed = next((v for v in verdicts if v[0] == "failed"), None)
        if failed is None and len({v[0] for v in verdicts}) > 1:  # one rank ran what another's core refused
            failed = ("failed", "the ranks disagree: " + "; ".join(f"rank {r}: {v[0]} {v[1]}".strip()
                                                                    for r, v in enumerate(verdicts)))
        return failed or verdicts[0]


def check_in(program: dict, strategy: str, precision: str, seed: int, tmp: Path, timeout: float) -> tuple[str, str]:
    """check() inside its temporary folder `tmp` (rank 0's, on every rank)."""
    from core import CoreError

    if strategy != "single":  # every rank writes into rank 0's folder
        import torch.distributed as dist
        box = [str(tmp)]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
    for side in ("core", "plain"):
        (tmp / side).mkdir(exist_ok=True)
    expect = program.get("expect")
    try:
        core = run_core(program, strategy, precision, seed, tmp / "core", timeout)
    except CoreError as error:  # a refusal: right only where the program was drawn to meet this one
        if expect and REFUSALS[expect][0] in str(error):
            return "refused", f"{expect}: {type(error).__name__}: {str(error).splitlines()[0]}"
        why = f"a refusal other than {expect!r} ({REFUSALS[expect][0]!r})" if expect else \
            "a refusal of a program core must run"
        return "failed", f"core raised {why}:\n" + traceback.format_exc(limit=-6)
    except TimeoutError:
        raise
    except Exception:  # noqa: BLE001 - anything else core raised, or let through, is a bug
        return "failed", "core crashed:\n" + traceback.format_exc(limit=-6)
    if expect:
        return "failed", f"core ran a program it must refuse: {expect} ({REFUSALS[expect][1]})"
    try:
        plain = run_plain(program, strategy, precision, seed, tmp / "plain")
    except Exception:  # noqa: BLE001
        return "failed", "the plain program crashed (a harness error):\n" + traceback.format_exc(limit=-6)
    lines = differences(core, plain)
    if lines:
        return "failed", "core and plain differ:\n  " + "\n  ".join(lines[:12])
    if not program.get("moved"):
        return "ok", ""
    return check_moved(program, f"{strategy}:{precision}", seed, tmp / "core" / "moved.ckpt", timeout)


def check_moved(program: dict, cell: str, seed: int, checkpoint: Path, timeout: float) -> tuple[str, str]:
    """Rank 0 starts the fresh process(es) that load the program's final checkpoint under `program["moved"]`
    (tests/contract/moved.py), and compares what each of their ranks holds with what rank 0 held at the save
    (through_core.run_core wrote each rank's, held{RANK}.pt): a save keeps rank 0's buffers, except that ZeRO-3's
    own load at the same stage and process count gives each rank back its own, as DeepSpeed's does."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return "ok", ""  # rank 0 decides; check() gathers its verdict
    source, cell, out = cell, program["moved"], checkpoint.parent / "moved"
    out.mkdir()
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("CORE_")}
    env.update(PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "tests.contract.moved", "--cell", cell, "--program", json.dumps(program),
               "--seed", str(seed), "--checkpoint", str(checkpoint), "--out", str(out)]
    failed = f"the load in a fresh process under {cell} failed"
    try:
        # within the bound of the collective the other ranks wait in meanwhile (check()), so that rank 0 reports
        ran = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=0.8 * timeout)
    except subprocess.TimeoutExpired:
        return "failed", f"{failed}: it ran past {0.8 * timeout:g} s"
    ranks = 1 if cell.startswith("single:") else 2
    files = [out / f"rank{r}.pt" for r in range(ranks)]
    if ran.returncode != 0 or not all(f.exists() for f in files):
        return "failed", f"{failed}: exit status {ran.returncode}\n{ran.stderr[-3000:]}"
    own = cell == source and cell.startswith("deepspeed_stage_3:")
    for r, f in enumerate(files):
        loaded = torch.load(f, weights_only=False)
        if "error" in loaded:
            return "failed", f"{failed}: rank {r} raised\n{loaded['error']}"
        saved = torch.load(checkpoint.parent / f"held{r if own else 0}.pt", weights_only=False)
        lines = differences(saved, moments(loaded))
        if lines:
            return "failed", f"{failed}: rank {r} holds other values than were saved:\n  " + "\n  ".join(lines[:12])
    return "ok", ""


@contextmanager
def float16_engine_offered(strategy: str, precision: str):
    """DeepSpeed's CPU accelerator offers its float16 engine only where oneDNN computes float16 (AVX512-FP16,
    AMX-FP16), and core refuses float16 under DeepSpeed elsewhere, reading the same answer. So that the float16
    cells compare core with DeepSpeed's float16 engine on any CPU, both sides are told yes here: float16
    arithmetic runs on every CPU, only slower."""
    if not strategy.startswith("deepspeed") or not precision.startswith("16-"):
        yield
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    asked = accelerator.is_fp16_supported
    accelerator.is_fp16_supported = lambda self: True
    try:
        yield
    finally:
        accelerator.is_fp16_supported = asked


def shrink(program: dict, strategy: str, precision: str, seed: int, timeout: float,
           first: str) -> tuple[dict, str, int]:
    """The smallest program `simpler` reaches that still fails the way it did (`first`: its detail), that detail,
    and how many programs it ran."""
    detail, tries, found = None, 0, True
    while found and tries < SHRINK_TRIES:
        found = False
        for candidate in simpler(program):
            if not fits(candidate, strategy, precision):
                continue
            candidate["expect"] = expected_refusal(candidate, strategy, precision)
            tries += 1
            verdict, why = check(candidate, strategy, precision, seed, timeout)
            if verdict == "failed" and (detail or first).split(":")[0] == why.split(":")[0]:  # the same kind of failure
                program, detail, found = candidate, why, True
                break
            if tries >= SHRINK_TRIES:
                break
    return program, detail, tries


def run_cells(cells: list[str], seed: int, count: int, index: int | None = None, out=sys.stdout,
              program: dict | None = None, shrink_failures: bool = True, timeout: float = 120.0,
              move_share: float = MOVE_SHARE) -> dict:
    """Run `count` programs in each cell ("strategy:precision"), all in this process group (or only program
    `index`, or the given `program`); return the counts, in all and per cell, and print each failure, shrunk,
    with its script and the commands that replay it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    totals = {"ok": 0, "refused": 0, "failed": 0}
    per_cell, refusals, moved = {}, {}, {}
    for cell in cells:
        strategy, precision = cell.split(":")
        counts = per_cell[cell] = {"ok": 0, "refused": 0, "failed": 0}
        with float16_engine_offered(strategy, precision):
            for i in range(count) if index is None and program is None else [index or 0]:
                drawn = program or draw(random.Random(f"{seed}:{cell}:{i}"), strategy, precision, move_share)
                try:
                    verdict, detail = check(drawn, strategy, precision, seed * 1000 + i, timeout)
                except TimeoutError as error:  # this rank waited past the program's bound: the others are elsewhere
                    print(f"\nHANG {cell} program {i}: {error}\n{script(drawn, strategy, precision)}\n"
                          f"{replay(cell, seed, i, drawn, move_share)}", file=sys.stderr, flush=True)
                    raise
                totals[verdict] += 1
                counts[verdict] += 1
                if verdict == "ok" and drawn.get("moved"):  # of the ok ones: loaded in a fresh process too
                    moved[drawn["moved"]] = moved.get(drawn["moved"], 0) + 1
                if verdict == "refused":
                    refusals[drawn["expect"]] = refusals.get(drawn["expect"], 0) + 1
                if verdict != "failed":
                    continue
                small, tries = drawn, 0
                if shrink_failures:
                    small, smaller_detail, tries = shrink(drawn, strategy, precision, seed * 1000 + i, timeout,
                                                          detail)
                    detail = smaller_detail or detail
                if rank == 0:
                    print(f"\nFAILED {cell} program {i} (shrunk in {tries} runs): {detail}\n"
                          f"{script(small, strategy, precision)}\n{replay(cell, seed, i, small, move_share)}",
                          file=out, flush=True)
    return {**totals, "cells": per_cell, "refusals": refusals, "moved to": moved}


def replay(cell: str, seed: int, index: int, program: dict, move_share: float = MOVE_SHARE) -> str:
    """The commands that run `program` again (as printed, and as drawn)."""
    command = f"python -m tests.contract --cells {cell}{' --devices 2' if cell.split(':')[0] != 'single' else ''} " \
              f"--seed {seed} --index {index}" + (f" --move-share {move_share:g}" if move_share != MOVE_SHARE else "")
    return f"replay: {command} --program '{json.dumps(program)}'\nas drawn: {command}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.contract", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--count", type=int, default=20, help="programs per cell")
    parser.add_argument("--devices", type=int, default=1, choices=[1, 2],
                        help="1: the one-process cells; 2: the distributed cells, on 2 processes")
    parser.add_argument("--cells", default=None,
                        help="comma-separated strategy:precision cells (default: every cell for --devices)")
    parser.add_argument("--index", type=int, default=None, help="run only this program of each cell (a replay)")
    parser.add_argument("--program", default=None, help="run this program (JSON, as a failure prints it) with "
                                                         "--index's seed, instead of drawing one")
    parser.add_argument("--no-shrink", action="store_true", help="print failures as drawn, without shrinking")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective of a distributed program may wait (its Fabric(timeout=...)): a "
                             "rank that waits longer prints HANG with the program and stops the run")
    parser.add_argument("--move-share", type=float, default=MOVE_SHARE,
                        help="the share of programs whose final checkpoint a fresh process loads, under a cell of "
                             "the same precision drawn for each (0 to 1)")
    args = parser.parse_args(argv)
    if not 0 <= args.move_share <= 1:
        parser.error(f"--move-share is a share of the programs, from 0 to 1; got {args.move_share:g}")
    cells = args.cells.split(",") if args.cells else (ONE_PROCESS if args.devices == 1 else TWO_PROCESSES)
    unknown = [cell for cell in cells if cell not in ONE_PROCESS + TWO_PROCESSES]
    if unknown:
        parser.error(f"unknown cells {unknown}; the cells are {', '.join(ONE_PROCESS + TWO_PROCESSES)}")
    if args.devices == 1 and any(not cell.startswith("single:") for cell in cells):
        parser.error("the distributed cells run on 2 processes: add --devices 2")
    program = None
    if args.program:
        try:
            program = json.loads(args.program)
        except json.JSONDecodeError as error:
            parser.error(f"--program is not a program's JSON ({error}); paste it as a failure printed it")
    torch.set_num_threads(1)
    # a scheduler may step in an iteration whose optimizer did not (a model without one, a skipped overflow)
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
    # DeepSpeed's "untested optimizer", once per engine (a filter: its import sets the logger's level)
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    if args.devices == 2:
        from core import Fabric
        Fabric(accelerator="cpu", strategy="ddp", devices=2).launch()  # the process group every program shares
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    result = run_cells(cells, args.seed, args.count, args.index, program=program, shrink_failures=not args.no_shrink,
                       timeout=args.timeout, move_share=args.move_share)
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0  # rank 0 reports for every rank
    print(json.dumps(result, indent=1), flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
