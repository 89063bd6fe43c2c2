"""Running programs: each through core and as plain PyTorch, one verdict per program agreed by every rank, and
the command line (`python -m tests.contract`)."""
import argparse
import json
import logging
import random
import re
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from tests.contract.compare import differences
from tests.contract.programs import ONE_PROCESS, TWO_PROCESSES, draw, script
from tests.contract.plain import run_plain
from tests.contract.through_core import core_error, run_core


def check(program: dict, strategy: str, precision: str, seed: int) -> tuple[str, str]:
    """("ok" | "refused" | "failed", detail) for one program."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return check_in(program, strategy, precision, seed, Path(tmp))
        finally:
            if strategy != "single":  # rank 0's folder is removed only when every rank is done with it
                import torch.distributed as dist
                dist.barrier()


def check_in(program: dict, strategy: str, precision: str, seed: int, tmp: Path) -> tuple[str, str]:
    """check() inside its temporary folder `tmp` (rank 0's, on every rank)."""
    if strategy != "single":  # every rank writes into rank 0's folder
        import torch.distributed as dist
        box = [str(tmp)]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
    for side in ("core", "plain"):
        (tmp / side).mkdir(exist_ok=True)
    try:
        core = run_core(program, strategy, precision, seed, tmp / "core")
    except Exception as error:  # noqa: BLE001 - classified below
        if core_error(error):
            return "refused", f"{type(error).__name__}: {str(error).splitlines()[0]}"
        return "failed", "core crashed:\n" + traceback.format_exc(limit=-6)
    try:
        plain = run_plain(program, strategy, precision, seed, tmp / "plain")
    except Exception:  # noqa: BLE001
        return "failed", "the plain program crashed (a harness error):\n" + traceback.format_exc(limit=-6)
    lines = differences(core, plain)
    return ("ok", "") if not lines else ("failed", "core and plain differ:\n  " + "\n  ".join(lines[:12]))


def run_cells(cells: list[str], seed: int, count: int, index: int | None = None, out=sys.stdout) -> dict:
    """Run `count` programs in each cell ("strategy:precision"), all in this process group; return the counts,
    and print each failure with its script and replay command."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    totals = {"ok": 0, "refused": 0, "failed": 0}
    refusals = {}
    for cell in cells:
        strategy, precision = cell.split(":")
        for i in range(count) if index is None else [index]:
            rng = random.Random(f"{seed}:{cell}:{i}")
            program = draw(rng, strategy, precision)
            verdict, detail = check(program, strategy, precision, seed * 1000 + i)
            if distributed or strategy != "single":
                import torch.distributed as dist
                verdicts = [None] * dist.get_world_size()
                dist.all_gather_object(verdicts, (verdict, detail))
                worst = next((v for v in verdicts if v[0] == "failed"), verdicts[0])
                verdict, detail = worst
            totals[verdict] += 1
            if verdict == "refused":
                refusals[detail] = refusals.get(detail, 0) + 1
            if verdict == "failed" and rank == 0:
                print(f"\nFAILED {cell} program {i}: {detail}\n{script(program)}\nreplay: python -m tests.contract "
                      f"--seed {seed} --cells {cell} --index {i}" + (" --devices 2" if strategy != "single" else "")
                      + f"\nprogram: {json.dumps(program)}", file=out, flush=True)
    return {**totals, "refusals": refusals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--count", type=int, default=20, help="programs per cell")
    parser.add_argument("--devices", type=int, default=1, choices=[1, 2],
                        help="1: the one-process cells; 2: the distributed cells, on 2 processes")
    parser.add_argument("--cells", default=None,
                        help="comma-separated strategy:precision cells (default: every cell for --devices)")
    parser.add_argument("--index", type=int, default=None, help="run only this program of each cell (a replay)")
    args = parser.parse_args(argv)
    cells = args.cells.split(",") if args.cells else (ONE_PROCESS if args.devices == 1 else TWO_PROCESSES)
    torch.set_num_threads(1)
    # a scheduler may step in an iteration whose optimizer did not (a model without one, a skipped overflow)
    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
    # DeepSpeed's "untested optimizer", once per engine (a filter: its import sets the logger's level)
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    if args.devices == 2:
        from core import Fabric
        Fabric(accelerator="cpu", strategy="ddp", devices=2).launch()  # the process group every program shares
    result = run_cells(cells, args.seed, args.count, args.index)
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0  # rank 0 reports for every rank
    print(json.dumps(result, indent=1), flush=True)
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
