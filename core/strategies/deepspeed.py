"""DeepSpeed strategy: ZeRO stages 1-3 (and CPU offload), one engine per set-up model.

DeepSpeed is imported only when this strategy is chosen. On CPU it runs on DeepSpeed's CPU accelerator over gloo; on
CUDA over NCCL. Each `setup(model, optimizer)` makes one engine, so a GAN has two; a wrapped optimizer steps its own
engine, and `fabric.backward(loss)` finds the engine from the loss's graph (or `model=`). DeepSpeed does its own loss
scaling and bf16/fp16 conversion, so core's autocast and GradScaler stay off under this strategy.

The config core builds changes nothing in the math of a step: DeepSpeed's gradient clipping (its default is 1.0) is
off unless the config sets it, and the offload modes step the user's own optimizer on the CPU copy of the weights
instead of insisting on DeepSpeed's CPUAdam. The strategy's name gives the ZeRO stage and offload; a user config may
add to them but not contradict them.

A checkpoint is a directory: one DeepSpeed checkpoint per engine (tag = the key in `state`; every rank writes its own
partitions), plus `state.pt` for the plain values and each engine's stage and number of processes. It is written to a
temporary directory and renamed into place. Loaded under the same stage and number of processes, the engines read it
themselves, each rank its own files. Anywhere else (another number of processes or stage, another strategy)
`read_deepspeed` merges the partitions into the logical checkpoint (DeepSpeed's zero_to_fp32 layout, for the
optimizer state too), and a DeepSpeed engine takes a logical checkpoint of any origin by setting each parameter's
slice of its partitions. DeepSpeed's own files are pickles of more than tensors: every one is read with
`weights_only=True` and a short list of allowed DeepSpeed and Python types, so a file carrying anything else is
refused unread.
"""
import copy
import importlib
import json
import logging
import os
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from core import checkpoint
from core.checkpoint import deepspeed as deepspeed_checkpoint
from core.checkpoint import space
from core.errors import CoreRuntimeError, CoreTypeError, CoreValueError
from core.precision.engine import EnginePrecision
from core.strategies.ddp import DDP
from core.strategies.shares import Zero3Shares
from core.wrappers import module_of_loss


def import_deepspeed(strategy: str, device_type: str) -> None:
    """DeepSpeed is an optional extra: when it is missing, say so once, before any process is started.
    When it is there, quiet what it brings that no user can act on."""
    # DeepSpeed picks its accelerator on import (once per process), and warns when it falls back to the CPU by
    # itself: DS_ACCELERATOR names it for the import only, so that it does not reach the user's subprocesses
    added = "DS_ACCELERATOR" not in os.environ
    os.environ.setdefault("DS_ACCELERATOR", device_type)
    # DeepSpeed imports torch.utils.cpp_extension, which on a machine without CUDA logs "No CUDA runtime is
    # found" once per process: nothing to act on when running on CPU.
    build_log = logging.getLogger("torch.utils.cpp_extension")
    level = build_log.level
    if not torch.cuda.is_available():
        build_log.setLevel(logging.ERROR)
    try:
        importlib.import_module("torch.utils.cpp_extension")
        import deepspeed  # noqa: F401
    except ImportError as error:
        raise ModuleNotFoundError(f"strategy {strategy!r} needs DeepSpeed, which cannot be imported ({error}); "
                                  f"install it with pip install -e '.[deepspeed]', or choose ddp or fsdp",
                                  name="deepspeed") from None
    finally:
        build_log.setLevel(level)
        if added:
            del os.environ["DS_ACCELERATOR"]
    # ZeRO calls torch collectives that torch 2.14 deprecates, and the warning comes back on every call
    # (242 lines in 30 GAN steps at stage 3): DeepSpeed's to change, not the user's.
    deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)


class DeepSpeed(DDP):
    joint_setup = True
    changes_module = True
    backward_needs_module = True
    guard_submodules = False  # ZeRO's hooks sit on parameters and modules, not on a wrapper's forward
    moves_module = False  # the engine places the module
    options_key = None  # DeepSpeed takes its options in the config

    def __init__(self, device, precision, stage: int | None = None, offload: bool = False, config=None, timeout=None):
        """`stage` None takes the stage from the config (2 if it has none); core's STRATEGIES give each
        `deepspeed_stage_*` name its fixed stage and offload. `timeout`: as for ddp."""
        super().__init__(device, precision, timeout=timeout)
        self.fixed_stage = stage is not None
        self.stage = stage if stage is not None else 2
        self.offload = offload
        if isinstance(config, (str, os.PathLike)):
            try:
                config = json.loads(Path(config).read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise CoreValueError(f"DeepSpeed config {config}: cannot read it as JSON ({error}).") from error
        if config is not None and not isinstance(config, dict):
            raise CoreTypeError(f"DeepSpeed config must be a dict or a JSON file path, got {type(config).__name__}.")
        self.user_config = config
        self._names = {}  # id(optimizer) -> the names of its parameters per group, for checkpoints
        self._engines = []  # one per set-up model: a loss without model= goes to the one its graph reaches
        import_deepspeed(self.name, device.type)  # imports DeepSpeed on this device's accelerator
        self.config()  # refuse a config that contradicts the strategy's name now, not at setup

    @classmethod
    def refusal(cls, needs: set, precision: str, options: dict) -> str | None:
        config = options.get("config") if isinstance(options.get("config"), dict) else {}
        zero = config.get("zero_optimization", {})
        stage = options.get("stage") or zero.get("stage", 2)
        if stage == 3 and "weights_outside_forward" in needs:
            return ("ZeRO-3 holds each parameter as an empty placeholder outside its own layer's forward (it gathers "
                    "a layer's weights only while that layer runs), so a script that reads the weights directly "
                    "sees nothing; use deepspeed_stage_1 or deepspeed_stage_2, ddp or fsdp")
        if "second_backward" in needs:
            return _second_backward_refusal(stage, precision, zero.get("contiguous_gradients", False))
        return None

    def choose_precision(self, precision):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if precision.dtype == torch.float16 and not accelerator.is_fp16_supported():
            raise CoreValueError(f"precision={precision.name!r} under strategy={self.name!r}: DeepSpeed's "
                                 f"{accelerator.device_name()} accelerator has no float16 engine. Use 'bf16-mixed' or "
                                 f"'32-true', or strategy='ddp' for 16-mixed with torch's loss scaler.")
        return EnginePrecision(precision)  # the engine converts the module to bf16/fp16 and scales the loss

    def config(self) -> dict:
        config = copy.deepcopy(self.user_config) if self.user_config is not None else {}
        zero = config.setdefault("zero_optimization", {})
        if self.fixed_stage and zero.get("stage", self.stage) != self.stage:
            raise CoreValueError(f"strategy={self.name!r} is ZeRO stage {self.stage}, but the DeepSpeed config sets "
                                 f"stage {zero['stage']}. Drop the stage from the config, or use strategy='deepspeed' "
                                 f"to take it from the config.")
        zero.setdefault("stage", self.stage)
        if "second_backward" in self.needs and zero["stage"] == 2:
            zero.setdefault("contiguous_gradients", False)  # its contiguous buckets fail in the second backward
        if self.offload:
            zero.setdefault("offload_optimizer", {"device": "cpu"})
            if self.stage == 3:
                zero.setdefault("offload_param", {"device": "cpu"})
        config.setdefault("gradient_clipping", 0.0)  # DeepSpeed's default, 1.0, clips every gradient to norm 1
        # offload steps the user's optimizer on the CPU weights; DeepSpeed would refuse any but its CPUAdam
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        config.setdefault("train_micro_batch_size_per_gpu", 1)  # batches are ours; this only feeds its logs
        config.setdefault("gradient_accumulation_steps", 1)
        # every engine.step is the accumulation boundary, however many backwards came before it (no_backward_sync)
        config.setdefault("managed_gradient_accumulation", False)
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
                                   auto_mpi_discovery=False, verbose=False, timeout=self.timeout)

    def setup_module_and_optimizers(self, module, optimizers: list, **kwargs):
        import deepspeed

        if kwargs:
            raise CoreValueError(f"DeepSpeed takes its options in the config, not per module; got {sorted(kwargs)}.")
        if len(optimizers) > 1:
            raise CoreValueError(
                "A DeepSpeed engine has one optimizer. Set up each model with its own optimizer "
                "(`fabric.setup(generator, optimizer_g)`, `fabric.setup(discriminator, optimizer_d)`), "
                "or put the parameters in one optimizer as param groups.")
        if optimizers:  # the names of its parameters, before ZeRO swaps them for its flat partitions
            self._names[id(optimizers[0])] = checkpoint.parameter_names(optimizers[0], module)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizers[0] if optimizers else None,
                                               config=self.config(), dist_init_required=False)
        self._engines.append(engine)
        if optimizers and engine.optimizer is not optimizers[0]:
            # ZeRO now steps the optimizer on its flat fp32 partitions, so the optimizer's own zero_grad would
            # clear their gradient buffers (which offload keeps between steps) instead of the module's gradients
            optimizers[0].zero_grad = engine.optimizer.zero_grad
        return engine, optimizers

    def parameter_shares(self):
        """Under ZeRO-3 each process holds a slice of each parameter (common/ema.py's `parameter_shares`)."""
        return Zero3Shares(self.all_gather, self.global_rank) if self.stage == 3 else None

    def backward(self, loss, module, *args, **kwargs) -> None:
        if args or kwargs.get("create_graph"):
            raise CoreValueError("DeepSpeed's engine.backward takes no gradient argument and cannot create a graph "
                                 "for higher-order gradients; use strategy='ddp' or 'fsdp' for that.")
        engine = module._forward_module if module is not None else module_of_loss(loss, self._engines)
        engine.backward(loss, retain_graph=kwargs.get("retain_graph", False))

    def optimizer_step(self, optimizer, module, **kwargs):
        if kwargs:
            raise CoreValueError("DeepSpeed's engine.step takes no closure.")
        module._forward_module.step()

    def no_backward_sync(self, module):
        return nullcontext()  # the engine accumulates every backward locally and reduces in its step

    def keep_for_second_backward(self, module, optimizers: list) -> None:
        """ZeRO-1 takes the second backward as it is, ZeRO-2 with its gradients kept apart (its contiguous
        gradient buckets fail: IndexError in reduce_ipg_grads); ZeRO-3 cannot (its partitioned convolution's
        double backward fails); under float16 the loss scale is the engine's own, which fabric.grad cannot apply."""
        zero = self.config()["zero_optimization"]
        reason = _second_backward_refusal(zero["stage"], self.precision.name, zero.get("contiguous_gradients", True))
        if reason:
            raise CoreRuntimeError(f"fabric.grad under strategy={self.name!r}: the loss's backward goes through the "
                                   f"gradient it returns, a second backward through the engine, and {reason} "
                                   f"(DeepSpeed {_version()}; or use strategy='ddp' or 'fsdp').")

    def clip_gradients(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        raise CoreRuntimeError(
            f"DeepSpeed clips gradients inside its engine's step, so fabric.clip_gradients cannot run between "
            f"backward and step. Ask the engine instead: Fabric(strategy={self.name!r}, config={{'gradient_clipping': "
            f"{max_norm}}}) clips the 2-norm of each model's gradients to {max_norm} at every step.")

    def clip_gradients_by_value(self, module, optimizer, clip_val):
        raise CoreRuntimeError(
            f"DeepSpeed clips gradients by norm only, inside its engine's step, so fabric.clip_gradients(clip_val=...) "
            f"cannot run under it. Clip by norm through the config instead: Fabric(strategy={self.name!r}, "
            f"config={{'gradient_clipping': MAX_NORM}}).")

    # --- checkpoints ------------------------------------------------------------------------------
    def parameter_names(self, optimizer, wrapped_module):
        return self._names[id(optimizer)]  # ZeRO replaced the optimizer's parameters with its flat partitions

    def module_state(self, wrapped):
        return checkpoint.InEngine(wrapped)  # saved by its engine in save_checkpoint

    def optimizer_state(self, optimizer, wrapped_module):
        return checkpoint.InEngine(wrapped_module)  # inside its model's engine checkpoint

    def background_group(self):
        raise CoreValueError("fabric.save(..., background=True) is not available under DeepSpeed: its engines write "
                             "their own files with their own collectives, which cannot run beside training. Save "
                             "without background=True.")

    def save_checkpoint(self, path, state: dict, group=None) -> None:
        path = Path(path)
        tmp = checkpoint.staging(path)
        checkpoint.clear_directory(tmp, self.global_rank, self.barrier)
        key_of = {id(value.wrapped): key for key, value in state.items() if isinstance(value, checkpoint.InEngine)}
        plain, problem, written = {}, None, []
        try:
            for key, value in state.items():
                if isinstance(value, checkpoint.InEngine):  # every rank writes (and hashes) its own partitions
                    written += deepspeed_checkpoint.save_engine(value.wrapped._forward_module, tmp, key)
                    shapes = {name: list(getattr(p, "ds_shape", p.shape))
                              for name, p in value.wrapped.module.named_parameters()}
                    plain[key] = {"deepspeed_tag": key, "world_size": self.world_size, "stage": self.stage,
                                  "shapes": shapes}
                elif isinstance(value, dict) and isinstance(value.get("optimizer"), checkpoint.InEngine):
                    if id(value["optimizer"].wrapped) not in key_of:
                        raise CoreValueError(
                            f"Under DeepSpeed an optimizer's state is saved with its model's engine: put the "
                            f"model that {key!r} updates into the same fabric.save call.")
                    plain[key] = {**value, "optimizer": {"deepspeed_tag": key_of[id(value["optimizer"].wrapped)]}}
                else:
                    plain[key] = value
            checkpoint.integrity.write_rank_hashes(tmp, self.global_rank, written)
            self.barrier()
            if self.global_rank == 0:
                checkpoint.save_checkpoint(plain, tmp / checkpoint.STATE, with_manifest=True)
        except BaseException as error:  # a full disk: the ranks share its filesystem, so each finds it at the
            if not space.lack_of_space(error):  # same file (a disk full for one rank only leaves the others in
                raise  # DeepSpeed's barriers until --collective-timeout)
            problem = "no space"
        checkpoint.stop_together_cleaned(path, tmp, self.global_rank, self.stop_together, problem)
        checkpoint.replace_directory(tmp, path, self.global_rank, self.barrier)

    def load_checkpoint(self, path, held=None) -> dict:
        """A checkpoint of this stage and number of processes loads through the engines (each rank reads its
        own partitions); any other is read as the logical checkpoint and put into the engines' partitions."""
        path = Path(path)
        if (path / checkpoint.STATE).is_file() and not (path / ".metadata").is_file():
            saved = checkpoint.load_checkpoint(path / checkpoint.STATE)
            layouts = [value for value in saved.values() if isinstance(value, dict) and "deepspeed_tag" in value]
            # a checkpoint written before core recorded the shape is taken to be this one's, as it had to be
            if layouts and all((v.get("world_size", self.world_size), v.get("stage", self.stage)) ==
                               (self.world_size, self.stage) for v in layouts):
                return saved
        return checkpoint.read(path)

    def load_module_state(self, wrapped, state: dict, strict: bool, key: str, path) -> None:
        if not isinstance(state, dict) or "deepspeed_tag" not in state:
            return deepspeed_checkpoint.load_full_module(wrapped._forward_module, state, strict, key)
        from deepspeed.runtime.zero.utils import ZeRORuntimeException

        engine = wrapped._forward_module
        if "shapes" in state:  # a ZeRO engine would fail on another shape deep inside, without naming it
            deepspeed_checkpoint.check_shapes(engine.module, state["shapes"], strict, key)
        try:
            with deepspeed_checkpoint.safe_loads(engine.checkpoint_engine, _version()):
                loaded, _ = engine.load_checkpoint(str(path), tag=state["deepspeed_tag"], load_module_strict=strict,
                                                   load_optimizer_states=True, load_lr_scheduler_states=False)
        except ZeRORuntimeException as error:
            raise checkpoint.CheckpointError(f"DeepSpeed cannot load {key!r} from {path}: {error}") from error
        if loaded is None:
            raise checkpoint.CheckpointError(f"DeepSpeed could not load {key!r} from {path}.")

    def load_optimizer_state(self, optimizer, wrapped_module, state) -> None:
        if not (isinstance(state, dict) and "param_groups" in state):
            return  # restored with its engine
        deepspeed_checkpoint.load_full_optimizer(wrapped_module._forward_module, state)


def _second_backward_refusal(stage: int, precision: str, contiguous_gradients: bool) -> str | None:
    if stage == 3:
        return "ZeRO-3's partitioned parameters fail in the double backward (a convolution's); use stage 1 or 2"
    if stage == 2 and contiguous_gradients:
        return ("ZeRO-2's contiguous gradient buckets fail in it; say so before setup, Fabric(..., "
                "needs={'second_backward'}), which turns them off (or drop contiguous_gradients from the config)")
    if precision in ("16-mixed", "16-true"):
        return "the engine keeps its float16 loss scale to itself; use bf16-mixed or 32-true"
    return None


def _version() -> str:
    import deepspeed
    return deepspeed.__version__
