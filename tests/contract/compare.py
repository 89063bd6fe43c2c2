"""What both sides hand back at the end of a program, and where two of them differ."""
import math

import torch


def results_of(strategy: str, models) -> dict:
    """Every model's full weights, each optimizer's state and learning rates, on every rank."""
    out = {}
    for i, (model, optimizers, wrapper) in enumerate(models):
        if strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)
            full = StateDictOptions(full_state_dict=True)
            weights = get_model_state_dict(model, options=full)
            states = [get_optimizer_state_dict(model, opt, options=full)["state"] for opt in optimizers]
        elif strategy.startswith("deepspeed"):
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=strategy.endswith("3")):
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            states = []  # ZeRO's flat partitions: compared through the weights they give
        else:
            weights = model.state_dict()
            states = [opt.state_dict()["state"] for opt in optimizers]
        out[f"model{i}"] = {k: v.detach().float().cpu().clone() for k, v in weights.items()}
        for j, (opt, state) in enumerate(zip(optimizers, states)):
            out[f"optimizer{i}.{j}"] = {"lr": [g["lr"] for g in opt.param_groups],
                                        "state": {str(k): {n: t.detach().float().cpu().clone() if torch.is_tensor(t)
                                                           else t for n, t in v.items()} for k, v in state.items()}}
    return out


def differences(core, plain, prefix="") -> list[str]:
    """Where two results differ (bitwise), as short lines."""
    if isinstance(core, dict) and isinstance(plain, dict):
        if set(core) != set(plain):
            return [f"{prefix}: keys {sorted(map(str, core))} vs {sorted(map(str, plain))}"]
        return [line for key in core for line in differences(core[key], plain[key], f"{prefix}.{key}".strip("."))]
    if isinstance(core, list) and isinstance(plain, list):
        if len(core) != len(plain):
            return [f"{prefix}: {len(core)} items vs {len(plain)}"]
        return [line for i, (a, b) in enumerate(zip(core, plain)) for line in differences(a, b, f"{prefix}[{i}]")]
    if torch.is_tensor(core) and torch.is_tensor(plain):  # bitwise, NaN where the other has NaN included
        if core.shape == plain.shape and torch.equal(core.isnan(), plain.isnan()) and \
                torch.equal(core.nan_to_num(0.0), plain.nan_to_num(0.0)):
            return []
        gap = (core - plain).abs().max().item() if core.shape == plain.shape else "shape"
        return [f"{prefix}: max difference {gap}"]
    if isinstance(core, float) and isinstance(plain, float) and math.isnan(core) and math.isnan(plain):
        return []
    return [] if core == plain else [f"{prefix}: {core} vs {plain}"]
