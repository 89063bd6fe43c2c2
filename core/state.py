"""Between a run's objects and the logical checkpoint (core/checkpoint): `collect` turns fabric.save's `state` into
state dicts (set-up modules and optimizers as their strategy saves them), `restore` loads what fabric.load read
back into them in place."""
import torch

from core.checkpoint import CheckpointError, check_state_dict, named_optimizer_state
from core.wrappers import FabricModule, FabricOptimizer


def collect(state: dict, strategy, precision, module_of: dict) -> dict:
    """What `fabric.save` writes for `state`: set-up modules and optimizers as the strategy's state dicts
    (with the loss scaler's state beside each optimizer), other modules and optimizers as their state dicts, the rest as is.
    `module_of` maps id(wrapped optimizer) to the FabricModule it updates."""
    def state_of(value):
        if isinstance(value, FabricModule):
            return strategy.module_state(value)
        if isinstance(value, FabricOptimizer):
            return {"optimizer": strategy.optimizer_state(value.optimizer, module_of[id(value)]),
                    "scaler": precision.state_dict(value.optimizer)}
        if hasattr(value, "state_dict"):
            return value.state_dict()
        return value
    return {key: state_of(value) for key, value in state.items()}


def restore(saved: dict, state: dict, strategy, precision, module_of: dict, path, strict: bool,
            raw: bool = False) -> dict:
    """Load `saved` into `state`'s objects in place and its plain values into `state`; return what `saved`
    holds beyond `state`. `raw`: `saved` holds bare state dicts (an optimizer's without its loss scale)."""
    missing = [key for key in state if key not in saved]
    if missing and strict:
        held = sorted(map(str, saved))
        shown = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
        raise CheckpointError(f"The checkpoint {path} has no {missing} (it holds {shown}): was it saved by another "
                              f"script or workload? In your own code, fabric.load(path, state, strict=False) loads "
                              f"what is there, and fabric.load_raw(path, model) a bare state dict.")
    for key, value in state.items():
        if key not in saved:
            continue
        if isinstance(value, FabricModule):
            strategy.load_module_state(value, saved[key], strict, key, path)
        elif isinstance(value, FabricOptimizer):
            entry = {"optimizer": saved[key], "scaler": None} if raw or "optimizer" not in saved[key] else saved[key]
            module = module_of[id(value)]
            optimizer_state = entry["optimizer"]
            if isinstance(optimizer_state, dict) and "param_groups" in optimizer_state:  # else: with its engine
                optimizer_state = named_optimizer_state(optimizer_state, strategy.parameter_names(value.optimizer,
                                                                                                  module))
            strategy.load_optimizer_state(value.optimizer, module, optimizer_state)
            precision.load_state_dict(value.optimizer, entry["scaler"])
        elif isinstance(value, torch.nn.Module):
            check_state_dict(value, saved[key], key, strict)
            value.load_state_dict(saved[key], strict=strict)
        elif hasattr(value, "load_state_dict"):
            value.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    return {key: value for key, value in saved.items() if key not in state}
