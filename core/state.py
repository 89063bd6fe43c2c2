"""fabric.save and fabric.load: between a run's objects and the logical checkpoint (core/checkpoint). `collect`
turns save's `state` into state dicts (set-up modules and optimizers as their strategy saves them), `restore` loads
what load read back into them in place: one Fabric's `Checkpoints`."""
import sys
from concurrent.futures import Future

import torch

from core import checkpoint
from core.checkpoint import CheckpointError, check_state_dict, named_optimizer_state
from core.checkpoint.background import BackgroundSaves, stage
from core.optimizers import FabricOptimizer
from core.wrappers import FabricModule


class Checkpoints:
    """One Fabric's saves and loads, through its strategy: what `fabric.save`, `fabric.load` and
    `fabric.wait_for_save` run. `module_of` maps id(wrapped optimizer) to the FabricModule it updates (the
    Fabric's own dict: it grows with each setup)."""

    def __init__(self, strategy, module_of: dict):
        self.strategy, self.module_of = strategy, module_of
        self.saves = BackgroundSaves()  # save(..., background=True)

    def collect(self, state: dict) -> dict:
        """What `fabric.save` writes for `state`: set-up modules and optimizers as the strategy's state dicts (with
        the loss scaler's state beside each optimizer), other modules and optimizers as their state dicts, the rest
        as is."""
        strategy, module_of = self.strategy, self.module_of

        def state_of(value):
            if isinstance(value, FabricModule):
                return strategy.module_state(value)
            if isinstance(value, FabricOptimizer):
                return {"optimizer": strategy.optimizer_state(value.optimizer, module_of[id(value)]),
                        "scaler": strategy.precision.state_dict(value.optimizer)}
            if hasattr(value, "state_dict"):
                return value.state_dict()
            return value
        return {key: state_of(value) for key, value in state.items()}

    def save(self, path, state: dict, background: bool, edit=None) -> Future | None:
        """`edit`: a function of the collected state that returns what is written (the drop-in's `filter`)."""
        def collected():
            return self.collect(state) if edit is None else edit(self.collect(state))
        self.saves.wait()
        if not background:
            self.strategy.save_checkpoint(path, collected())
            return None
        group = self.strategy.background_group()  # (DeepSpeed refuses here, before anything is collected)
        return self.saves.start(path, self.strategy.save_checkpoint, stage(collected()), group, self.strategy.device)

    def load(self, path, state: dict | None, strict: bool, weights_only: bool | None) -> dict:
        self.saves.wait()  # a background save of this path must be whole before it is read
        held = None if state is None else (lambda: self.collect(state))
        checkpoint.recover(path)  # a save of this path killed in its renames or its cleanup
        note = self.strategy.verify_checkpoint(path)  # its bytes as they were saved, or refused
        with checkpoint.trusted(weights_only is False):
            saved = self.strategy.load_checkpoint(path, held)
        if note and self.strategy.global_rank == 0:  # (after the load: a file that fails to load says only that)
            print(f"[core] {note}: loaded without checking its bytes.", file=sys.stderr, flush=True)
        return saved if state is None else self.restore(saved, state, path, strict)

    def restore(self, saved: dict, state: dict, path, strict: bool, raw: bool = False) -> dict:
        """Load `saved` into `state`'s objects in place and its plain values into `state`; return what `saved`
        holds beyond `state`. `raw`: `saved` holds bare state dicts (an optimizer's without its loss scale)."""
        strategy = self.strategy
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
                module = self.module_of[id(value)]
                optimizer_state = entry["optimizer"]
                if isinstance(optimizer_state, dict) and "param_groups" in optimizer_state:  # else: with its engine
                    optimizer_state = named_optimizer_state(optimizer_state, strategy.parameter_names(value.optimizer,
                                                                                                      module))
                strategy.load_optimizer_state(value.optimizer, module, optimizer_state)
                strategy.precision.load_state_dict(value.optimizer, entry["scaler"])
            elif isinstance(value, torch.nn.Module):
                check_state_dict(value, saved[key], key, strict)
                value.load_state_dict(saved[key], strict=strict)
            elif hasattr(value, "load_state_dict"):
                value.load_state_dict(saved[key])
            else:
                state[key] = saved[key]
        return {key: value for key, value in saved.items() if key not in state}
