"""DeepSpeed checkpoints in and out of the logical checkpoint (full tensors keyed by parameter name).

`read_deepspeed` merges the ZeRO partitions that every rank of a run wrote (any stage, any number of
processes) into each engine's weights and optimizer state, with the layout functions of DeepSpeed's own
zero_to_fp32 (which also holds the optimizer state: its tensors are laid out like the fp32 weights).
`load_full_module` and `load_full_optimizer` put a logical checkpoint of any origin into the partitions of
an engine of any stage. Every DeepSpeed file is read by `safe_loader`: `weights_only=True` and a short list
of allowed DeepSpeed and Python types, so a file carrying anything else is refused unread.
"""
import contextlib
import io
import pickle
from pathlib import Path

import torch

from core.checkpoint import files


def check_shapes(module, saved: dict, strict: bool, key: str) -> None:
    """Refuse a checkpoint whose parameters (`saved`: name -> shape) are not this module's, naming them."""
    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}
    shapes.update({name: tuple(b.shape) for name, b in module.named_buffers()})
    problems = [f"{name}: checkpoint {tuple(shape)} vs model {shapes[name]}" for name, shape in saved.items()
                if name in shapes and tuple(shape) != shapes[name]]
    if strict:
        problems += [f"{name}: not in the model" for name in saved if name not in shapes]
        problems += [f"{name}: missing from the checkpoint" for name in shapes if name not in saved and
                     name in dict(module.named_parameters())]
    if problems:
        raise files.CheckpointError(f"The checkpoint's {key!r} does not match the model: "
                                    f"{'; '.join(problems[:8])}. Was it saved from a model of another shape?")


def load_full_module(engine, state: dict, strict: bool, key: str) -> None:
    """Put a logical (full, named) state dict into an engine: its fp32 master weights, the module's own
    weights (ZeRO-3: through a gather and re-partition) and buffers."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = engine.module
    check_shapes(module, {name: value.shape for name, value in state.items()}, strict, key)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in state:
                continue
            value = state[name].to(torch.float32)
            if p.requires_grad:
                safe_set_full_fp32_param(p, value.to(p.device))
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=hasattr(p, "ds_id")):
                p.data.copy_(value.view(p.shape))
        for name, b in module.named_buffers():
            if name in state:
                b.copy_(state[name])


def load_full_optimizer(engine, state: dict) -> None:
    """Put a logical (named) optimizer state into an engine's ZeRO partitions: create the partitions' state
    with a step of learning rate 0 on zero gradients (as torch.distributed.checkpoint does for a fresh
    optimizer), then set each parameter's slice of it, the step count and the hyperparameters."""
    from deepspeed.utils import safe_set_full_optimizer_state

    zero, base = engine.optimizer, engine.optimizer.optimizer
    groups = state["param_groups"]  # one per group of the engine's optimizer, each with its own hyperparameters
    if len(groups) != len(base.param_groups):
        raise files.CheckpointError(f"The checkpoint's optimizer has {len(groups)} parameter groups; this "
                                    f"DeepSpeed engine splits them into {len(base.param_groups)}, which core "
                                    f"cannot pair. Resume with the strategy that saved it.")
    stage = engine.zero_optimization_stage()  # by the stage, not by which attributes the optimizer has: a DeepSpeed
    # that renamed one fails here (AttributeError) instead of taking the other stage's branch
    if not base.state:
        if stage == 3:  # ZeRO-3 puts each sub-group's partition in its group to step
            pairs = [(base.param_groups[zero.sub_group_to_group_id[i]], flat)
                     for i, flat in enumerate(zero.fp32_partitioned_groups_flat)]
        else:
            pairs = [(group, flat) for group in base.param_groups for flat in group["params"]]
        for group, flat in pairs:
            params, grad, rate = group["params"], flat.grad, group["lr"]
            group.update(params=[flat], lr=0.0)
            flat.grad = torch.zeros_like(flat)
            base.step()
            group.update(params=params, lr=rate)
            flat.grad = grad
    if stage in (1, 2):  # link each parameter to its state slice
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    names = dict(engine.module.named_parameters())
    scalars = {}
    for name, entries in state["state"].items():
        for k, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0:  # one number per weight (exp_avg, momentum_buffer)
                safe_set_full_optimizer_state(names[name], value.to(torch.float32), k)
            else:  # the step count: ZeRO keeps one per flat partition, equal for all of an optimizer's weights
                scalars[k] = value
    for flat_state in base.state.values():
        for k, value in scalars.items():
            flat_state[k] = value.clone() if torch.is_tensor(value) else value
    for group, saved in zip(base.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


# DeepSpeed functions that are not its public API, which reading its partitions needs; setup.cfg pins the
# minor version the tests ran, and check_private_api names the installed one when any is gone
PRIVATE_API = {"deepspeed.utils.zero_to_fp32": ("_get_fp32_state_dict_from_zero2_checkpoint",
                                                "_get_fp32_state_dict_from_zero3_checkpoint", "zero_model_state",
                                                "get_model_state_files", "get_optim_files", "to_torch_tensor"),
               # load_full_optimizer: ZeRO-1/2 link each weight to its optimizer state slice with these
               "deepspeed.runtime.zero.stage_1_and_2": ("DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",),
               # safe_loads (below) shadows this to read DeepSpeed's files weights-only
               "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": ("TorchCheckpointEngine.load",)}


def check_private_api() -> None:
    import importlib

    import deepspeed
    for module, names in PRIVATE_API.items():
        found = importlib.import_module(module)
        missing = [name for name in names if not _has(found, name.split("."))]
        if missing:
            raise files.CheckpointError(
                f"DeepSpeed {deepspeed.__version__} lacks {module}.{', '.join(missing)}, which core reads DeepSpeed "
                f"checkpoints with; install the version setup.cfg names (pip install -e '.[deepspeed]').")


def _has(obj, names: list[str]) -> bool:
    return not names or hasattr(obj, names[0]) and _has(getattr(obj, names[0]), names[1:])


def read_deepspeed(path) -> dict:
    """A checkpoint directory that Fabric.save wrote under DeepSpeed, as the logical checkpoint: each engine's
    fp32 weights and optimizer state merged from the partitions of every rank (DeepSpeed's zero_to_fp32
    layout), keyed by parameter name. Each process reading it holds the whole state."""
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        raise files.CheckpointError(f"{path} is a DeepSpeed checkpoint; reading it needs DeepSpeed: pip install "
                                    f"-e '.[deepspeed]'.") from None
    check_private_api()
    path = Path(path)
    saved = files.load_checkpoint(path / files.STATE)
    engines = {}
    for key, value in saved.items():
        if isinstance(value, dict) and "deepspeed_tag" in value:
            engines[key] = _merge_partitions(path / value["deepspeed_tag"], zero_to_fp32)
            saved[key] = engines[key][0]
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(value.get("optimizer"), dict) and \
                "deepspeed_tag" in value["optimizer"]:
            saved[key] = {**value, "optimizer": engines[value["optimizer"]["deepspeed_tag"]][1]}
    return saved


def _merge_partitions(folder: Path, z) -> tuple[dict, dict]:
    """(weights, optimizer state) of one engine, from its files of every rank."""
    load = safe_loader(map_location="cpu")
    models = [load(f) for f in z.get_model_state_files(str(folder))]
    optims = [load(f)["optimizer_state_dict"] for f in z.get_optim_files(str(folder))]
    stage, world_size = optims[0]["zero_stage"], optims[0]["partition_count"]
    world_size = max(world_size) if isinstance(world_size, list) else world_size
    if len(optims) != world_size:
        raise files.CheckpointError(f"{folder} holds {len(optims)} optimizer partitions of {world_size}: a rank's "
                                    f"files are missing. Resume from an earlier checkpoint.")
    states = []
    for model in models:
        buffers = {k: v for k, v in model["module"].items() if k in model["buffer_names"]}
        states.append(z.zero_model_state(buffers=buffers, param_shapes=model["param_shapes"],
                                         shared_params=list(model["shared_params"].items()),
                                         ds_version=model.get("ds_version"),
                                         frozen_param_shapes=model.get("frozen_param_shapes"),
                                         frozen_param_fragments=model.get("frozen_param_fragments")))
    flat_key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    paddings = optims[0].get("param_alignment_paddings")

    def merge(flat_groups):  # each rank's list of flat partitions -> {name: full tensor}
        if stage <= 2:
            merged = z._get_fp32_state_dict_from_zero2_checkpoint(world_size, flat_groups, states, False, paddings)
        else:
            merged = z.to_torch_tensor(z._get_fp32_state_dict_from_zero3_checkpoint(world_size, flat_groups,
                                                                                      states, False))
        return {name: value.clone() for name, value in merged.items()}

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        weights = merge([o[flat_key] for o in optims])
    # ZeRO-1 keeps the weights its user froze only in the module's state (ZeRO-2 and -3 in fields merged above):
    # the module's tensors that are neither trained weights nor buffers (all merged above)
    trained = {name for shapes in states[0].param_shapes for name in shapes}
    weights.update({name: value.clone() for name, value in models[0]["module"].items()
                    if name not in weights and name not in trained and torch.is_tensor(value)})
    base = [o["base_optimizer_state"] if stage <= 2 else o["optimizer_state_dict"] for o in optims]  # the torch optimizer's
    names = [list(shapes) for shapes in states[0].param_shapes]  # the parameters of each flat group, in order
    hyper = base[0]["param_groups"]
    if not len(names) == len(hyper) == len(optims[0][flat_key]):
        raise files.CheckpointError(f"{folder}: its {len(hyper)} optimizer groups, {len(names)} groups of parameters "
                                    f"and {len(optims[0][flat_key])} flat partitions do not pair up, which core "
                                    f"cannot read; resume with the strategy and process count that saved it.")

    def per_weight(value) -> bool:  # laid out like the flat weights (exp_avg, momentum_buffer): merged like them
        return torch.is_tensor(value) and value.dim() > 0

    per_param = {name: {} for group in names for name in group}
    for k in sorted({k for b in base for group_state in b["state"].values() for k in group_state}):
        # a group may lack a key another has (SGD keeps no momentum buffer in a group with momentum 0): zeros
        # stand in for its partitions in the merge, and its parameters get no entry
        holders = [g for g in range(len(names)) if per_weight(base[0]["state"].get(g, {}).get(k))]
        if holders:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                full = merge([[b["state"][g][k] if g in holders else torch.zeros_like(o[flat_key][g])
                               for g in range(len(names))] for b, o in zip(base, optims)])
            for g in holders:
                for name in names[g]:
                    per_param[name][k] = full[name]
        for g, group_state in base[0]["state"].items():  # one per flat partition (the step count): each parameter
            if k in group_state and not per_weight(group_state[k]):  # its own copy, which optimizers update in place
                for name in names[g]:
                    per_param[name][k] = group_state[k].clone() if torch.is_tensor(group_state[k]) else group_state[k]
    param_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": group}
                    for saved, group in zip(hyper, names)]
    # a torch optimizer keeps no entry for a weight without state (SGD without momentum), and torch's fsdp loader
    # cannot place entries that hold no tensor
    return weights, {"state": {name: entries for name, entries in per_param.items() if entries},
                     "param_groups": param_groups}


def safe_loader(**defaults):
    """torch.load with weights_only=True and a few allowed DeepSpeed and Python types: what DeepSpeed's own
    files hold. Anything else is refused unread."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, set, frozenset, slice,
               torch.Size]

    def load(file, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(file, map_location=map_location or defaults.get("map_location"), weights_only=True)
        except pickle.UnpicklingError as error:
            raise files.CheckpointError(f"{file} holds objects outside the allowed tensor and DeepSpeed "
                                        f"types, so it was refused unread: "
                                        f"{str(error).splitlines()[0][:200]}") from error
        except (RuntimeError, EOFError, OSError) as error:
            raise files.CheckpointError(f"{file} is not readable ({str(error).splitlines()[0][:200]}). "
                                        f"Resume from an earlier checkpoint.") from error
    return load


def save_engine(engine, directory: Path, tag: str) -> list[str]:
    """`engine.save_checkpoint` of this rank's part under `directory/tag`; the files this rank wrote (each goes
    through the engine's checkpoint engine's `save`), for its hashes (integrity.write_rank_hashes)."""
    written, save = [], engine.checkpoint_engine.save

    def recorded(state_dict, path, *args, **kwargs):
        written.append(path)
        return save(state_dict, path, *args, **kwargs)
    engine.checkpoint_engine.save = recorded  # shadows the class's save for this call
    try:
        engine.save_checkpoint(str(directory), tag=tag, save_latest=False)
    finally:
        del engine.checkpoint_engine.save
    return written


@contextlib.contextmanager
def safe_loads(checkpoint_engine, version: str):
    """Within: every file DeepSpeed reads through this engine's checkpoint engine (the files of this rank,
    each once) is read by `safe_loader`. A DeepSpeed that read its files another way would
    bypass it: a block that read nothing through it is an error, not a silent unsafe load."""
    safe_load, reads = safe_loader(), []

    def load(*args, **kwargs):
        reads.append(args[0] if args else kwargs.get("path"))
        return safe_load(*args, **kwargs)
    checkpoint_engine.load = load  # shadows the class's load, which unpickles anything
    try:
        yield
    finally:
        del checkpoint_engine.load
    if not reads:
        raise files.CheckpointError(
            f"DeepSpeed {version} loaded a checkpoint without reading any file through its checkpoint engine's "
            f"`load`, which core shadows to read only tensors and DeepSpeed's own types; install the version "
            f"setup.cfg names (pip install -e '.[deepspeed]').")
