"""DeepSpeed strategy: ZeRO stages 1-3 (and CPU offload), one engine per set-up model.

DeepSpeed is imported only when this strategy is chosen. On CPU it runs on DeepSpeed's CPU
accelerator over gloo; on CUDA over NCCL. Each `setup(model, optimizer)` makes one engine, so a GAN
has two; a wrapped optimizer steps its own engine, and `fabric.backward(loss)` finds the engine
from the loss's graph (or `model=`). DeepSpeed does its own loss scaling and bf16/fp16 conversion,
so core's autocast and GradScaler stay off under this strategy.

The config core builds changes nothing in the math of a step: DeepSpeed's gradient clipping (its
default is 1.0) is off unless the config sets it, and the offload modes step the user's own optimizer
on the CPU copy of the weights instead of insisting on DeepSpeed's CPUAdam. The strategy's name gives
the ZeRO stage and offload; a user config may add to them but not contradict them.

A checkpoint is a directory: one DeepSpeed checkpoint per engine (tag = the key in `state`; every rank
writes its own partitions), plus `state.pt` for the plain values and each engine's stage and number of
processes. It is written to a temporary directory and renamed into place. Loaded under the same stage and
number of processes, the engines read it themselves, each rank its own files. Anywhere else (another
number of processes or stage, another strategy) `read_deepspeed` merges the partitions into the logical
checkpoint (DeepSpeed's zero_to_fp32 layout, for the optimizer state too), and a DeepSpeed engine takes a
logical checkpoint of any origin by setting each parameter's slice of its partitions. DeepSpeed's own
files are pickles of more than tensors: every one is read with `weights_only=True` and a short list of
allowed DeepSpeed and Python types, so a file carrying anything else is refused unread.
"""
import contextlib
import copy
import io
import json
import os
import pickle
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from core import checkpoint
from core.strategies import DDP

class DeepSpeed(DDP):
    joint_setup = True
    backward_needs_module = True
    guard_submodules = False  # ZeRO's hooks sit on parameters and modules, not on a wrapper's forward
    moves_module = False  # the engine places the module
    options_key = None  # DeepSpeed takes its options in the config

    def __init__(self, device, precision, stage: int | None = None, offload: bool = False, config=None):
        """`stage` None takes the stage from the config (2 if it has none); core's STRATEGIES give each
        `deepspeed_stage_*` name its fixed stage and offload."""
        super().__init__(device, precision)
        self.fixed_stage = stage is not None
        self.stage = stage if stage is not None else 2
        self.offload = offload
        self.name = f"deepspeed_stage_{stage}{'_offload' if offload else ''}" if stage is not None else "deepspeed"
        if isinstance(config, (str, os.PathLike)):
            try:
                config = json.loads(Path(config).read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise ValueError(f"DeepSpeed config {config}: cannot read it as JSON ({error}).") from None
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"DeepSpeed config must be a dict or a JSON file path, got {type(config).__name__}.")
        self.user_config = config
        self._names = {}  # id(optimizer) -> the names of its parameters per group, for checkpoints
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        self.config()  # refuse a config that contradicts the strategy's name now, not at setup

    def choose_precision(self, precision):
        return precision.under_engine()  # the engine converts the module to bf16/fp16 and scales the loss

    def config(self) -> dict:
        config = copy.deepcopy(self.user_config) if self.user_config is not None else {}
        zero = config.setdefault("zero_optimization", {})
        if self.fixed_stage and zero.get("stage", self.stage) != self.stage:
            raise ValueError(f"strategy={self.name!r} is ZeRO stage {self.stage}, but the DeepSpeed config sets "
                             f"stage {zero['stage']}. Drop the stage from the config, or use strategy='deepspeed' "
                             f"to take it from the config.")
        zero.setdefault("stage", self.stage)
        if self.offload:
            zero.setdefault("offload_optimizer", {"device": "cpu"})
            if self.stage == 3:
                zero.setdefault("offload_param", {"device": "cpu"})
        config.setdefault("gradient_clipping", 0.0)  # DeepSpeed's default, 1.0, clips every gradient to norm 1
        # offload steps the user's optimizer on the CPU weights; DeepSpeed would refuse any but its CPUAdam
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        config.setdefault("train_micro_batch_size_per_gpu", 1)  # batches are ours; this only feeds its logs
        config.setdefault("gradient_accumulation_steps", 1)
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("steps_per_print", 2**31)
        for key, value in self.precision.deepspeed_config().items():
            config.setdefault(key, value)
        return config

    def setup_environment(self, env: dict) -> None:
        super().setup_environment(env)
        # the engine reads LOCAL_RANK; launchers set it, but one process started alone has none
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False, verbose=False)

    def setup_module_and_optimizers(self, module, optimizers: list, **kwargs):
        import deepspeed

        if kwargs:
            raise ValueError(f"DeepSpeed takes its options in the config, not per module; got {sorted(kwargs)}.")
        if len(optimizers) > 1:
            raise ValueError("A DeepSpeed engine has one optimizer. Set up each model with its own optimizer "
                             "(`fabric.setup(generator, optimizer_g)`, `fabric.setup(discriminator, optimizer_d)`), "
                             "or put the parameters in one optimizer as param groups.")
        if optimizers:  # the names of its parameters, before ZeRO swaps them for its flat partitions
            self._names[id(optimizers[0])] = checkpoint.parameter_names(optimizers[0], module)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizers[0] if optimizers else None,
                                               config=self.config(), dist_init_required=False)
        if optimizers and engine.optimizer is not optimizers[0]:
            # ZeRO now steps the optimizer on its flat fp32 partitions, so the optimizer's own zero_grad would
            # clear their gradient buffers (which offload keeps between steps) instead of the module's gradients
            optimizers[0].zero_grad = engine.optimizer.zero_grad
        return engine, optimizers

    def backward(self, loss, module, *args, **kwargs) -> None:
        if args or kwargs.get("create_graph"):
            raise ValueError("DeepSpeed's engine.backward takes no gradient argument and cannot create a graph "
                             "for higher-order gradients; use strategy='ddp' or 'fsdp' for that.")
        module._forward_module.backward(loss, retain_graph=kwargs.get("retain_graph", False))

    def optimizer_step(self, optimizer, module, **kwargs):
        if kwargs:
            raise ValueError("DeepSpeed's engine.step takes no closure.")
        module._forward_module.step()

    def no_backward_sync(self, module):
        raise RuntimeError("no_backward_sync is not available with DeepSpeed: set gradient_accumulation_steps "
                           "in the DeepSpeed config and call backward and step every micro-batch instead.")

    def clip_gradients(self, module, optimizer, max_norm, norm_type=2.0):
        # ZeRO moves gradients into its partitions during backward and clips them inside engine.step
        raise RuntimeError(f"DeepSpeed clips gradients inside its engine's step, so fabric.clip_gradients cannot "
                           f"run between backward and step. Ask the engine instead: Fabric(strategy={self.name!r}, "
                           f"config={{'gradient_clipping': {max_norm}}}) clips the 2-norm of each model's gradients "
                           f"to {max_norm} at every step.")

    def clip_gradients_by_value(self, module, optimizer, clip_val):
        raise RuntimeError(f"DeepSpeed clips gradients by norm only, inside its engine's step, so "
                           f"fabric.clip_gradients(clip_val=...) cannot run under it. Clip by norm through the config "
                           f"instead: Fabric(strategy={self.name!r}, config={{'gradient_clipping': MAX_NORM}}).")

    # --- checkpoints ------------------------------------------------------------------------------
    def parameter_names(self, optimizer, wrapped_module):
        return self._names[id(optimizer)]  # ZeRO replaced the optimizer's parameters with its flat partitions

    def module_state(self, wrapped):
        return wrapped  # saved by its engine in save_checkpoint

    def optimizer_state(self, optimizer, wrapped_module):
        return wrapped_module  # inside its engine's checkpoint; save_checkpoint names the engine

    def save_checkpoint(self, path, state: dict) -> None:
        from core.wrappers import FabricModule

        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        checkpoint.clear_directory(tmp, self.global_rank, self.barrier)
        key_of = {id(value): key for key, value in state.items() if isinstance(value, FabricModule)}
        plain = {}
        for key, value in state.items():
            if isinstance(value, FabricModule):  # every rank writes its own partitions
                value._forward_module.save_checkpoint(str(tmp), tag=key, save_latest=False)
                plain[key] = {"deepspeed_tag": key, "world_size": self.world_size, "stage": self.stage}
            elif isinstance(value, dict) and isinstance(value.get("optimizer"), FabricModule):
                if id(value["optimizer"]) not in key_of:
                    raise ValueError(f"Under DeepSpeed an optimizer's state is saved with its model's engine: put the "
                                     f"model that {key!r} updates into the same fabric.save call.")
                plain[key] = {**value, "optimizer": {"deepspeed_tag": key_of[id(value["optimizer"])]}}
            else:
                plain[key] = value
        self.barrier()
        if self.global_rank == 0:
            checkpoint.save_checkpoint(plain, tmp / "state.pt")
        checkpoint.replace_directory(tmp, path, self.global_rank, self.barrier)

    def load_checkpoint(self, path, held=None) -> dict:
        """A checkpoint of this stage and number of processes loads through the engines (each rank reads its
        own partitions); any other is read as the logical checkpoint and put into the engines' partitions."""
        path = Path(path)
        if (path / "state.pt").is_file() and not (path / ".metadata").is_file():
            saved = checkpoint.load_checkpoint(path / "state.pt")
            layouts = [value for value in saved.values() if isinstance(value, dict) and "deepspeed_tag" in value]
            if layouts and all((v.get("world_size"), v.get("stage")) == (self.world_size, self.stage) for v in layouts):
                return saved
        return checkpoint.read(path)

    def load_module_state(self, wrapped, state: dict, strict: bool, key: str, path) -> None:
        if not isinstance(state, dict) or "deepspeed_tag" not in state:
            return _load_full_module(wrapped._forward_module, state, strict, key)
        from deepspeed.runtime.zero.utils import ZeRORuntimeException

        engine = wrapped._forward_module
        try:
            with _safe_loads(engine.checkpoint_engine):
                loaded, _ = engine.load_checkpoint(str(path), tag=state["deepspeed_tag"], load_module_strict=strict,
                                                   load_optimizer_states=True, load_lr_scheduler_states=False)
        except ZeRORuntimeException as error:
            raise checkpoint.CheckpointError(f"DeepSpeed cannot load {key!r} from {path}: {error}") from None
        if loaded is None:
            raise checkpoint.CheckpointError(f"DeepSpeed could not load {key!r} from {path}.")

    def load_optimizer_state(self, optimizer, wrapped_module, state) -> None:
        if isinstance(state, dict) and "deepspeed_tag" in state:
            return  # restored with its engine
        _load_full_optimizer(wrapped_module._forward_module, state)


def _load_full_module(engine, state: dict, strict: bool, key: str) -> None:
    """Put a logical (full, named) state dict into an engine: its fp32 master weights, the module's own
    weights (ZeRO-3: through a gather and re-partition) and buffers."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    module = engine.module
    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}
    shapes.update({name: tuple(b.shape) for name, b in module.named_buffers()})
    problems = [f"{name}: checkpoint {tuple(value.shape)} vs model {shapes[name]}" for name, value in state.items()
                if name in shapes and tuple(value.shape) != shapes[name]]
    if strict:
        problems += [f"{name}: missing from the checkpoint" for name in shapes if name not in state]
        problems += [f"{name}: not in the model" for name in state if name not in shapes]
    if problems:
        raise checkpoint.CheckpointError(f"The checkpoint's {key!r} does not match the model: "
                                         f"{'; '.join(problems[:8])}. Was it saved from a model of another shape?")
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


def _load_full_optimizer(engine, state: dict) -> None:
    """Put a logical (named) optimizer state into an engine's ZeRO partitions: create the partitions' state
    with a step of learning rate 0 on zero gradients (as torch.distributed.checkpoint does for a fresh
    optimizer), then set each parameter's slice of it, the step count and the hyperparameters."""
    from deepspeed.utils import safe_set_full_optimizer_state

    zero, base = engine.optimizer, engine.optimizer.optimizer
    if not base.state:
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3 puts each sub-group's partition in its group to step
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
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2: link each parameter to its state slice
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
    groups = state["param_groups"]
    for number, group in enumerate(base.param_groups):  # ZeRO-3 may split one group into sub-groups
        saved = groups[min(number, len(groups) - 1)] if len(groups) == len(base.param_groups) or len(groups) == 1 \
            else None
        if saved is None:
            raise checkpoint.CheckpointError(f"The checkpoint's optimizer has {len(groups)} parameter groups; this "
                                             f"DeepSpeed engine splits them into {len(base.param_groups)}, which core "
                                             f"cannot pair. Resume with the strategy that saved it.")
        group.update({k: v for k, v in saved.items() if k != "params"})


def read_deepspeed(path) -> dict:
    """A checkpoint directory that Fabric.save wrote under DeepSpeed, as the logical checkpoint: each engine's
    fp32 weights and optimizer state merged from the partitions of every rank (DeepSpeed's zero_to_fp32
    layout), keyed by parameter name. Each process reading it holds the whole state."""
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:
        raise checkpoint.CheckpointError(f"{path} is a DeepSpeed checkpoint; reading it needs DeepSpeed: pip install "
                                         f"-e '.[deepspeed]'.") from None
    path = Path(path)
    saved = checkpoint.load_checkpoint(path / "state.pt")
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
    load = _safe_loader(map_location="cpu")
    models = [load(f) for f in z.get_model_state_files(str(folder))]
    optims = [load(f)["optimizer_state_dict"] for f in z.get_optim_files(str(folder))]
    stage, world_size = optims[0]["zero_stage"], optims[0]["partition_count"]
    world_size = max(world_size) if isinstance(world_size, list) else world_size
    if len(optims) != world_size:
        raise checkpoint.CheckpointError(f"{folder} holds {len(optims)} optimizer partitions of {world_size}: a rank's "
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
    base = [o["base_optimizer_state"] if stage <= 2 else o["optimizer_state_dict"] for o in optims]  # the torch optimizer's
    groups = sorted(base[0]["state"])
    names = [list(shapes) for shapes in states[0].param_shapes]
    per_param = {name: {} for group in names for name in group}
    for k, value in base[0]["state"][groups[0]].items():
        if torch.is_tensor(value) and value.dim() > 0:  # laid out like the flat weights: merged like them
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                full = merge([[b["state"][g][k] for g in groups] for b in base])
            for name in per_param:
                per_param[name][k] = full[name]
        else:  # one per flat partition (the step count): each parameter gets its own copy, which torch
            for name in per_param:  # optimizers update in place
                per_param[name][k] = value.clone() if torch.is_tensor(value) else value
    hyper = base[0]["param_groups"]
    param_groups = [{**{k: v for k, v in hyper[min(i, len(hyper) - 1)].items() if k != "params"}, "params": group}
                    for i, group in enumerate(names)]
    return weights, {"state": per_param, "param_groups": param_groups}


def _safe_loader(**defaults):
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
            raise checkpoint.CheckpointError(f"{file} holds objects outside the allowed tensor and DeepSpeed "
                                             f"types, so it was refused unread: "
                                             f"{str(error).splitlines()[0][:200]}") from None
        except (RuntimeError, EOFError, OSError) as error:
            raise checkpoint.CheckpointError(f"{file} is not readable ({str(error).splitlines()[0][:200]}). "
                                             f"Resume from an earlier checkpoint.") from None
    return load


@contextmanager
def _safe_loads(checkpoint_engine):
    """Within: every file DeepSpeed reads through this engine's checkpoint engine (the files of this rank,
    each once) is read by `_safe_loader`."""
    checkpoint_engine.load = _safe_loader()  # shadows the class's load, which unpickles anything
    try:
        yield
    finally:
        del checkpoint_engine.load
