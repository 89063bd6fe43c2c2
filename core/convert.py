"""Turn any checkpoint core writes (one file, a sharded fsdp directory, a DeepSpeed directory) into one
plain file: each model's and optimizer's state dict as torch.optim and nn.Module load them, and the plain
values, read by `torch.load(path, weights_only=True)`, the plain scripts' `--resume`, and `fabric.load`
under any strategy.

    python -m core.convert runs/gan-20261201-0730 plain.ckpt     # a run directory, or its checkpoint
    python -m gan.train_torch --resume plain.ckpt --out runs/gan-plain   # continue it in plain PyTorch
"""
import argparse
import sys
from pathlib import Path

from core import checkpoint
from core.errors import CoreValueError


def convert(source, target) -> dict:
    """Write `source` (a checkpoint or a run directory) as one plain file at `target`; return what was written."""
    found, _ = checkpoint.integrity.problems(source)  # a new file would carry new checksums over changed bytes
    if found:
        raise checkpoint.CheckpointError(checkpoint.integrity.refusal(source, found))
    state = checkpoint.read(source)
    plain = {}
    for key, value in state.items():
        if isinstance(value, dict) and isinstance(value.get("optimizer"), dict) and "scaler" in value:
            value = value["optimizer"]  # a set-up optimizer's entry: its state dict and its loss scale
        if isinstance(value, dict) and "param_groups" in value and "state" in value:  # by position, in saved order
            value = checkpoint.indexed_optimizer_state(value, [group["params"] for group in value["param_groups"]])
        plain[key] = value
    checkpoint.atomic_save(plain, target)
    return plain


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m core.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a run directory, or a checkpoint (a file, or a sharded or DeepSpeed folder)")
    parser.add_argument("target", help="the plain file to write")
    args = parser.parse_args(argv)
    try:
        if not args.source or not args.target:  # Path("") is the current folder
            raise CoreValueError(f"the {'target' if args.source else 'source'} is empty; pass a run directory or a "
                                 f"checkpoint, then the plain file to write")
        source = Path(args.source)
        if (source / "checkpoints" / "last.ckpt").exists():  # a run directory
            source = source / "checkpoints" / "last.ckpt"
        elif source.name == "checkpoints" and (source / "last.ckpt").exists():  # as --resume takes RUN/checkpoints
            source = source / "last.ckpt"
        if not source.exists():
            raise CoreValueError(f"no checkpoint at {source}")
        if Path(args.target).is_dir():  # the file would replace the folder and all it holds
            raise CoreValueError(f"the target {args.target} is a folder; name the plain file to write, e.g. "
                                 f"{Path(args.target) / 'plain.ckpt'}")
        if Path(args.target).resolve() == source.resolve():
            raise CoreValueError(f"the target {args.target} is the checkpoint itself; write the plain file elsewhere")
        written = convert(source, args.target)
    except (ValueError, OSError) as error:  # CheckpointError is a ValueError
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    kinds = ", ".join(f"{key}" for key in written)
    print(f"Wrote {args.target} ({kinds}) from {source}.", file=sys.stderr)


if __name__ == "__main__":
    main()
