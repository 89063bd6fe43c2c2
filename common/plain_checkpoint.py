"""The plain scripts' checkpoint: the state dicts of their (DDP-unwrapped) models and optimizers and plain
values in one file, which also reads the one-file checkpoints of the wrapped scripts."""
from pathlib import Path

import torch

from common.files import atomic_write


def save_plain(path: Path, state: dict) -> None:
    """The plain variant's checkpoint: state_dicts of the (DDP-unwrapped) models and optimizers plus plain
    values, written to a temporary file and renamed, so a crash mid-write keeps the previous checkpoint."""
    data = {key: getattr(value, "module", value).state_dict() if hasattr(value, "state_dict") else value
            for key, value in state.items()}
    atomic_write(path, lambda f: torch.save(data, f))


def load_plain(path: Path, state: dict, device) -> None:
    """Restore what save_plain wrote into `state` in place (weights_only: nothing in the file is executed).
    It also reads the one-file checkpoints of the wrapped scripts (single and ddp runs), whose optimizer state
    is keyed by parameter name, and the file `python -m core.convert` makes of any other checkpoint."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--resume {path}: a sharded (fsdp) or DeepSpeed checkpoint directory, which the plain "
                         f"scripts do not read. Make one file of it first: python -m core.convert {path} plain.ckpt, "
                         f"then --resume plain.ckpt --out NEW_RUN_DIR")
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except MemoryError:
        raise
    except Exception as error:  # truncated, garbage, or pickled objects weights_only refuses (none run)
        raise ValueError(f"--resume {path} is not a readable checkpoint (truncated, corrupt, or holding objects "
                         f"other than tensors: {type(error).__name__}); resume from an earlier checkpoint") from error
    if not isinstance(saved, dict):
        raise ValueError(f"--resume {path} holds a {type(saved).__name__}, not a checkpoint's dict of state dicts")
    missing = [key for key in state if key not in saved]
    if missing:
        raise ValueError(f"--resume {path} holds no {', '.join(missing)}: not a checkpoint of this workload, or one "
                         f"written by an older version of the wrapped script; make one file of it with "
                         f"python -m core.convert {path} plain.ckpt, then --resume plain.ckpt --out NEW_RUN_DIR")
    for key, value in state.items():
        if not hasattr(value, "load_state_dict"):
            state[key] = saved[key]
        elif isinstance(value, torch.optim.Optimizer):
            value.load_state_dict(positional_optimizer_state(saved[key]))
        else:
            getattr(value, "module", value).load_state_dict(saved[key])


def positional_optimizer_state(state: dict) -> dict:
    """An optimizer state dict keyed by parameter name (what core saves) as torch.optim numbers it: by the
    position of each parameter in the optimizer's groups, which the same script builds in the same order."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    if not all(isinstance(name, str) for name in names):
        return state
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}
