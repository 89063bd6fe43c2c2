"""What both sides hand back at the end of a program, and where two of them differ."""
import math

import torch


def results_of(strategy: str, models) -> dict:
    """Every model's full weights, and each optimizer's state (by parameter name) and learning rates, on every
    rank: the same shape under every strategy, so that a checkpoint loaded under another compares too."""
    out = {}
    for i, (model, optimizers, wrapper) in enumerate(models):
        if strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)
            full = StateDictOptions(full_state_dict=True)
            weights = get_model_state_dict(model, options=full)
            states = [get_optimizer_state_dict(model, opt, options=full)["state"] for opt in optimizers]  # by name
        elif strategy.startswith("deepspeed"):
            import deepspeed
            from deepspeed.utils import safe_get_full_fp32_param
            with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=strategy.endswith("3")):
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            # the float32 weights the engine steps (the module's are their bf16/fp16 copies), where it keeps them
            masters = {name: safe_get_full_fp32_param(p) for name, p in model.named_parameters() if p.requires_grad}
            weights.update({name: value for name, value in masters.items() if value is not None})
            states = [deepspeed_state(model, opt, wrapper) for opt in optimizers]
        else:
            weights = model.state_dict()
            states = [by_name(model, opt) for opt in optimizers]
        out[f"model{i}"] = {k: v.detach().float().cpu().clone() for k, v in weights.items()}
        for j, (opt, state) in enumerate(zip(optimizers, states)):
            out[f"optimizer{i}.{j}"] = {"lr": [g["lr"] for g in opt.param_groups],
                                        "state": {str(k): {n: t.detach().float().cpu().clone() if torch.is_tensor(t)
                                                           else t for n, t in v.items()} for k, v in state.items()}}
    return out


def by_name(model, optimizer) -> dict:
    """A torch optimizer's state keyed by the parameter's name in `model` (its position where it is not one)."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {names.get(id(p), str(k)): optimizer.state[p] for k, p in enumerate(params) if p in optimizer.state}


def deepspeed_state(model, optimizer, engine) -> dict:
    """A ZeRO optimizer's moments, gathered from its partitions per parameter name by DeepSpeed's own API (Adam's
    exp_avg and exp_avg_sq; SGD here keeps none)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    zero = engine.optimizer
    if hasattr(zero, "_hp_optimizer_states_linked"):  # ZeRO-1/2: engine.load_checkpoint links each weight anew but
        zero._hp_optimizer_states_linked = False  # not to its optimizer state (DeepSpeed does that at its first
        zero._lazy_init_hp_params_optimizer_state()  # step only), and the API fails on the weights until relinked
    adam = isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.Adam)  # under ZeRO's, or not
    # an optimizer that never stepped holds no moments, on every rank's partition alike (the API would fail on the
    # ranks whose partition holds part of a weight, and wait for them on the others)
    stepped = any("exp_avg" in entries for entries in zero.optimizer.state.values())
    keys = ("exp_avg", "exp_avg_sq") if adam and stepped else ()
    state = {}
    for name, p in model.named_parameters():
        moments = {key: safe_get_full_optimizer_state(p, key) for key in keys} if p.requires_grad else {}
        if any(t is None for t in moments.values()):  # a trained weight of an optimizer that stepped
            raise RuntimeError(f"DeepSpeed gave no {keys} for {name}: the harness reads its optimizer state "
                               f"wrong (a DeepSpeed that renamed what deepspeed_state relinks?)")
        if moments:
            state[name] = moments
    return state


def moments(result: dict) -> dict:
    """`result` as a load under another strategy must give it back: the weights, the learning rates, and the
    optimizers' per-parameter moments (their step counts are not all kept per parameter: DeepSpeed's are not)."""
    return {key: value if key.startswith("model") else
            {"lr": value["lr"], "state": {name: {k: t for k, t in s.items() if k != "step"}
                                          for name, s in value["state"].items()}}
            for key, value in result.items() if key.startswith(("model", "optimizer"))}


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
