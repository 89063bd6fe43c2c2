"""core's contract, tested by generated programs: each program runs through core and as the plain PyTorch that
does the same (DDP, FSDP2 and DeepSpeed engines, autocast and one GradScaler written out), and the two must end
bitwise equal, or core must refuse the program with the refusal it was drawn to meet, as core's own error
(`core.CoreError`). Anything else is a failure, printed shrunk to a small program with the commands that replay it.

    python -m tests.contract --seed 0 --count 50                 # every one-process cell, 50 programs each
    python -m tests.contract --seed 0 --count 10 --devices 2     # ddp, fsdp, deepspeed 1-3 on 2 processes
    python -m tests.contract --cells ddp:16-mixed --devices 2 --seed 0 --index 7   # one program, as drawn

What a program holds, and the cells, are in docs/core.md ("The contract, tested") and programs.py (`draw`).
"""
from tests.contract.programs import ONE_PROCESS, TWO_PROCESSES  # noqa: F401
from tests.contract.run import run_cells  # noqa: F401
