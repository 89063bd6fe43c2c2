"""core's contract, tested by generated programs: each program runs through core and as the plain PyTorch that
does the same (DDP, FSDP2 and DeepSpeed engines, autocast and one GradScaler written out), and the two must end
with bitwise equal weights, optimizer state, learning rates and data order, or core must refuse a call with its
own error (a ValueError, TypeError or RuntimeError raised in core/ that says what to do instead).

    python -m tests.contract --seed 0 --count 50                 # every one-process cell, 50 programs each
    python -m tests.contract --seed 0 --count 10 --devices 2     # ddp, fsdp, deepspeed 1-3 on 2 processes
    python -m tests.contract --seed 0 --count 10 --devices 2 --cells ddp:16-mixed --index 7   # one program

A program (`draw`) is 1-3 small models, each set up jointly or with setup_module + setup_optimizers, with 0-2
optimizers (SGD, so a scaled or clipped gradient shows, or Adam) over all or part of its parameters, a step-LR
scheduler built before or after setup; a loader shuffled by its sampler, by a DistributedSampler inside a
BatchSampler, or a DataLoader subclass, for 1-2 epochs; and per iteration one of: one loss through every model,
a loss per model, a GAN-style pair (the second model frozen in the first's step), or gradient accumulation under
no_backward_sync; with clipping by norm or value, an lr edit through param_groups, zero_grad(set_to_none=False),
an overflowing loss (16-mixed), a save then load that rewinds the iteration, and an optimizer's load_state_dict
after that load. A failing program prints as the core script it ran, with the command that replays it.
"""
from tests.contract.programs import ONE_PROCESS, TWO_PROCESSES  # noqa: F401
from tests.contract.run import run_cells  # noqa: F401
