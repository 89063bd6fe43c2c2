"""A program's final checkpoint loaded in a fresh process, under a cell of its own (started by run.check_moved):
new models, optimizers and schedulers (other initial weights) set up as the program sets them up, then
`fabric.load`, then each rank writes what it holds (compare.results_of) to OUT/rankR.pt, or what it raised.

    python -m tests.contract.moved --cell ddp:32-true --program JSON --seed 7 --checkpoint DIR/moved.ckpt --out DIR
"""
import argparse
import json
import logging
import traceback
from pathlib import Path

import torch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.contract.moved", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", required=True, help="strategy:precision to load under (2 processes unless single)")
    parser.add_argument("--program", required=True, help="the program, as JSON")
    parser.add_argument("--seed", type=int, required=True, help="the program's seed")
    parser.add_argument("--checkpoint", required=True, help="the checkpoint the program saved")
    parser.add_argument("--out", required=True, help="the folder each rank writes rankR.pt into")
    args = parser.parse_args(argv)
    from core import Fabric
    from tests.contract.run import float16_engine_offered
    from tests.contract.through_core import CoreOps, build

    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    strategy, precision = args.cell.split(":")
    program = json.loads(args.program)
    with float16_engine_offered(strategy, precision):
        if strategy == "single":
            fabric = Fabric(accelerator="cpu", precision=precision)
        else:
            fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, precision=precision, timeout=60)
            fabric.launch()
        try:
            ops = CoreOps(fabric, build(fabric, program, args.seed + 2), rebuild=None)
            ops.load(Path(args.checkpoint))
            result = ops.results()
        except Exception:  # noqa: BLE001 - handed back to the program's run, which fails it with this
            result = {"error": traceback.format_exc(limit=-6)}
    torch.save(result, Path(args.out) / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
