"""The Fabric object: one `setup()` for models, optimizers and data loaders under any strategy.

    fabric = Fabric(strategy="ddp", devices=2, precision="bf16-mixed")
    fabric.launch()
    generator, optimizer_g = fabric.setup(generator, optimizer_g)
    discriminator, optimizer_d = fabric.setup(discriminator, optimizer_d, ddp={"broadcast_buffers": False})
    loader = fabric.setup_dataloaders(loader)
    fabric.backward(loss)
"""
import weakref
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from core import launcher, validation
from core.collectives import Collectives
from core.errors import CoreRuntimeError, CoreTypeError, CoreValueError
from core.loaders import setup_loader
from core.optimizers import BackwardState, FabricOptimizer, OptimizerStep, wrap_optimizer
from core.precision import make_precision
from core.state import Checkpoints
from core.strategies import STRATEGIES, make_strategy
from core.wrappers import (FabricModule, compile_like, frozen_parameters, module_of_loss, uncopyable,
                           unwrap_compiled)


_NO_FUNCTION = object()  # launch() without a function (None is refused, as Lightning refuses it)


class Fabric(Collectives):
    """Moves models to the device, applies precision, wraps them for a strategy and wraps their optimizers.

    Args:
        accelerator: "cpu", "cuda" (or "gpu"), or "auto" (CUDA when available; the default).
        strategy: a name in core.strategies.STRATEGIES; "auto" (the default) is "ddp" for several processes
            and "single" otherwise.
        devices: processes per node (GPUs, or CPU processes), or "auto" (the default).
        num_nodes: machines (default 1); more than one needs torchrun or SLURM to start the processes.
        precision: a name in core.precision.PRECISIONS ("32-true", the default, "bf16-mixed", "16-mixed",
            "bf16-true", "16-true", "64-true") or one of Lightning's aliases ("bf16", "16", 32, ...).
        needs: what the script needs of every strategy (names in core.strategies.NEEDS: "second_backward",
            "weights_outside_forward"); a strategy that cannot give one refuses here with the reason, and one
            that can prepares for it (DeepSpeed ZeRO-2 keeps its gradients apart for a second backward).
        **strategy_options: defaults for the strategy, e.g. find_unused_parameters=True for ddp,
            reshard_after_forward=False for fsdp, config=dict-or-json-path for deepspeed.

    What Lightning Fabric offers beyond a training step (callbacks, loggers, `fabric run`, ddp_spawn, ...) is
    the drop-in layer above this class: `from core.compat import Fabric`.
    """

    strategies = STRATEGIES  # the names this Fabric builds strategies from

    def __init__(self, accelerator: str = "auto", strategy: str = "auto", devices="auto", num_nodes: int = 1,
                 precision="32-true", needs=(), **strategy_options):
        validation.check_not_drop_in(strategy_options)
        accelerator, strategy, devices, num_nodes, env = validation.resolve_arguments(
            accelerator, strategy, devices, num_nodes, self.strategies)
        kind = validation.device_kind(accelerator)
        self._devices, self._num_nodes = devices, num_nodes
        device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
        self._strategy = make_strategy(strategy, device, make_precision(precision, device), strategy_options,
                                       self.strategies, needs)
        self._precision = self._strategy.precision  # the strategy's variant of the mode
        if self._strategy.distributed:  # known before launch, as Lightning reports them
            self._strategy.world_size = devices * num_nodes
            if env:
                self._strategy.global_rank, self._strategy.local_rank = env["global_rank"], env["local_rank"]
                self._strategy.node_rank = env["node_rank"]
        self._launched = False
        self._set_up_modules = weakref.WeakSet()
        self._set_up_optimizers = weakref.WeakSet()
        self._module_of = {}  # id(wrapped optimizer) -> its FabricModule, for checkpoints and loss scaling
        self._optimizers_of = {}  # id(FabricModule) -> its wrapped optimizers
        self._modules = []  # FabricModules, in setup order
        self._checkpoints = Checkpoints(self._strategy, self._module_of)  # save and load
        # where an engine runs the backward or the loss is scaled, loss.backward() alone would skip that work: a
        # set-up optimizer then refuses to step on gradients that no fabric.backward made
        self._backward = BackwardState(required=self._strategy.backward_needs_module or self._precision.scales_loss)

    # --- launching --------------------------------------------------------------------------------
    def launch(self, function=_NO_FUNCTION, *args, **kwargs):
        """Start the processes of the run. With `function`, run `function(fabric, *args, **kwargs)` and return its
        result."""
        if function is not _NO_FUNCTION:
            validation.check_launch_function(function, args, kwargs)
        elif kwargs:  # launch(fn=train) or a misspelt keyword: nothing would run it
            raise CoreTypeError(f"fabric.launch() got the keyword arguments {sorted(kwargs)} but no function to pass "
                                f"them to; pass the function first (or as function=): fabric.launch(train, **kwargs).")
        else:
            function = None
        if self._launched:
            raise CoreRuntimeError("fabric.launch() was called twice; call it once, at the start of the run.")
        if self._strategy.distributed:
            self._start_distributed(launcher.start(self._devices, self._num_nodes))
        self._launched = True
        return function(self, *args, **kwargs) if function is not None else None

    def _start_distributed(self, env: dict) -> None:
        self._strategy.setup_environment(env)
        launcher.end_run_at_exit(self._strategy.teardown)
        self._launched = True

    def _check_launched(self) -> None:
        if not self._launched and self._strategy.distributed:
            raise CoreRuntimeError(
                f"strategy={self._strategy.name!r} with {self._devices * self._num_nodes} process(es) needs the "
                f"processes started first: call `fabric.launch()` before setup, or `fabric.launch(fn)`, or start "
                f"the script with torchrun.")

    # --- setup -------------------------------------------------------------------------------------
    def setup(self, module: nn.Module, *optimizers, scheduler=None, move_to_device: bool = True, **module_options):
        """Set up a module with its optimizers (and scheduler). Returns the module alone, or
        (module, *optimizers), or (module, *optimizers, scheduler).

        `module_options` go to this module's wrapper only, named by strategy: `ddp={...}` for the
        DistributedDataParallel arguments (broadcast_buffers, find_unused_parameters, ...), `fsdp={...}`
        for wrap_modules, reshard_after_forward, cpu_offload. Options for another strategy than the one
        running are not used, so one script can carry the options of each."""
        self._check_launched()
        validation.check_module(module, self._set_up_modules, self._strategy)
        validation.check_optimizers(optimizers, self._set_up_optimizers, self._strategy)
        if scheduler is not None and not optimizers:
            raise CoreValueError("A scheduler was passed to setup without any optimizer; pass the optimizer it "
                                 "schedules too: setup(model, optimizer, scheduler=scheduler).")
        validation.check_ownership(module, optimizers)
        module, compiled = unwrap_compiled(module)
        module = self._prepare(module, move_to_device)
        forward_module, optimizers = self._strategy.setup_module_and_optimizers(
            module, list(optimizers), **validation.module_options(module_options, self._strategy))
        wrapped = self._register_module(forward_module, module, compiled)
        wrapped_optimizers = [self._register_optimizer(opt, wrapped) for opt in optimizers]
        self._after_setup(module, wrapped, wrapped_optimizers)
        outputs = [wrapped, *wrapped_optimizers] + ([scheduler] if scheduler is not None else [])
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def setup_module(self, module: nn.Module, move_to_device: bool = True, **module_options) -> FabricModule:
        """Set up a module alone; create its optimizer from the returned module's parameters afterwards."""
        self._check_launched()
        self._check_split_setup()
        validation.check_module(module, self._set_up_modules, self._strategy)
        module, compiled = unwrap_compiled(module)
        module = self._prepare(module, move_to_device)
        options = validation.module_options(module_options, self._strategy)
        wrapped = self._register_module(self._strategy.setup_module(module, **options), module, compiled)
        self._after_setup(module, wrapped, None)
        return wrapped

    def _check_split_setup(self) -> None:
        if self._strategy.joint_setup:
            raise CoreRuntimeError(f"The {self._strategy.name!r} strategy does not support setting up the module and "
                                   f"optimizer(s) independently: model and optimizers must be set up jointly. Use "
                                   f"`fabric.setup(model, *optimizers)`.")

    def setup_optimizers(self, *optimizers):
        """Wrap optimizers built from the parameters of modules returned by setup_module."""
        self._check_split_setup()
        if not optimizers:
            raise CoreValueError("`setup_optimizers` requires at least one optimizer.")
        validation.check_optimizers(optimizers, self._set_up_optimizers, self._strategy)
        wrapped = []
        for opt in optimizers:
            owner = validation.owner_module(opt, self._modules)
            validation.check_ownership(owner.module, [opt])
            self._strategy.check_optimizer(opt, owner)
            wrapped.append(self._register_optimizer(opt, owner))
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def setup_dataloaders(self, *dataloaders, use_distributed_sampler: bool = True, move_to_device: bool = True):
        """Shard each loader across processes (DistributedSampler, seeded by seed_everything's seed; any other
        sampler is shared out by ShardedSampler), move its batches to the device, and with
        seed_everything(workers=True) seed its workers' `random` and NumPy."""
        if not dataloaders:
            raise CoreValueError("`setup_dataloaders` requires at least one dataloader.")
        self._check_launched()
        move = self.to_device if move_to_device and self.device.type != "cpu" else None
        wrapped = [setup_loader(loader, self.world_size, self.global_rank, use_distributed_sampler, move)
                   for loader in dataloaders]
        return wrapped[0] if len(wrapped) == 1 else wrapped

    def _prepare(self, module: nn.Module, move_to_device: bool) -> nn.Module:
        self._set_up_modules.add(module)
        on_meta = any(p.device.type == "meta" for p in module.parameters())  # the strategy materialises it
        if move_to_device and self._strategy.moves_module and not on_meta:
            module = module.to(self.device)
        return self._precision.convert_module(module)

    def _register_module(self, forward_module, module, compiled=None) -> FabricModule:
        """`compiled`: the torch.compile'd module the user passed; the strategy wrapped what it compiled, and
        the wrapper is compiled again with the same settings (the module itself, where nothing wraps it)."""
        guard = self._strategy.guard_submodules and forward_module is not module
        if compiled is not None:
            forward_module = compile_like(forward_module, module, compiled, self._strategy)
        wrapped = FabricModule(forward_module, module, self._precision, guard=guard,
                               uncopyable=uncopyable(self._strategy.name) if self._strategy.changes_module else None)
        shares = self._strategy.parameter_shares()
        if shares is not None:  # in the instance dict: not a submodule, not forwarded to the original module
            wrapped.__dict__["parameter_shares"] = shares
        self._modules.append(wrapped)
        self._optimizers_of[id(wrapped)] = []
        return wrapped

    def _register_optimizer(self, optimizer, module: FabricModule) -> FabricOptimizer:
        self._set_up_optimizers.add(optimizer)
        self._precision.add_optimizer(optimizer)
        wrapped = wrap_optimizer(optimizer, self._step_function(optimizer, module))
        self._module_of[id(wrapped)] = module
        self._optimizers_of[id(module)].append(wrapped)
        return wrapped

    def _step_function(self, optimizer, module: FabricModule):
        """What the set-up optimizer's `step(closure)` calls: the strategy's step, after the check that
        fabric.backward ran (an object, so that copies of the optimizer step themselves: optimizers.OptimizerStep)."""
        return OptimizerStep(optimizer, module, self._strategy, self._backward)

    def _after_setup(self, module: nn.Module, wrapped: FabricModule, optimizers: list | None) -> None:
        """Called at the end of setup (`optimizers` is None for setup_module): nothing here; the drop-in layer
        links a LightningModule and calls its callbacks."""

    # --- training step -----------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, *args, model: FabricModule | None = None, **kwargs) -> None:
        """`tensor.backward(*args, **kwargs)` through the strategy and precision (create_graph,
        retain_graph pass through). `model` says which set-up model this loss is for, where the
        strategy needs to know (DeepSpeed's engines) and the graph alone does not say."""
        self._backward.count += 1
        self._strategy.backward(self._precision.scale_loss(tensor), model, *args, **kwargs)

    def grad(self, outputs, inputs, grad_outputs=None, create_graph: bool = True, model: FabricModule | None = None):
        """`torch.autograd.grad(outputs, inputs, grad_outputs, create_graph=create_graph)` through set-up modules,
        for a penalty on the gradient with respect to the inputs (R1, WGAN-GP) whose own gradient
        `fabric.backward` then takes with the loss. Under 16-mixed the outputs are scaled by the loss
        scale and the gradients unscaled, so an overflow leaves inf in them and the scaler skips that step as it
        would for the loss; under fsdp the model's parameters stay gathered until its optimizer steps; DeepSpeed
        ZeRO-1 and -2 take it (ZeRO-2 with contiguous_gradients off), ZeRO-3 and DeepSpeed's float16 modes refuse
        it with the reason. `model`: as for backward."""
        module = model if model is not None else module_of_loss(
            outputs if isinstance(outputs, torch.Tensor) else outputs[0], self._modules)
        optimizers = [wrapped.optimizer for wrapped in self._optimizers_of.get(id(module), [])]
        if create_graph:  # a backward through the gradient follows
            self._strategy.keep_for_second_backward(module, optimizers)
        return self._precision.input_gradients(outputs, inputs, grad_outputs, create_graph)

    def clip_gradients(self, module: FabricModule, optimizer: FabricOptimizer, clip_val=None, max_norm=None,
                       norm_type: float = 2.0, error_if_nonfinite: bool = True):
        """Clip by value or by total norm (returns the norm before clipping). By norm, a NaN or infinite norm
        raises a RuntimeError unless `error_if_nonfinite=False` (Lightning's default, and torch's option)."""
        if (clip_val is None) == (max_norm is None):
            raise CoreValueError("clip_gradients takes exactly one of clip_val or max_norm.")
        if max_norm is not None:
            return self._strategy.clip_gradients(module, optimizer.optimizer, max_norm, norm_type,
                                                 error_if_nonfinite=error_if_nonfinite)
        self._strategy.clip_gradients_by_value(module, optimizer.optimizer, clip_val)
        return None

    def autocast(self):
        """The precision's forward context, for code that runs outside a set-up module's forward."""
        return self._precision.forward_context()

    @contextmanager
    def no_backward_sync(self, *modules: FabricModule, enabled: bool = True):
        """Skip gradient synchronisation of these modules (gradient accumulation)."""
        validation.check_set_up_modules(modules, "no_backward_sync")
        with ExitStack() as stack:
            if enabled:
                for m in modules:
                    stack.enter_context(self._strategy.no_backward_sync(m))
            yield

    @contextmanager
    def frozen(self, *modules: FabricModule):
        """Run set-up modules as fixed functions: no gradients for their parameters and no gradient sync.
        Gradients still flow through them to their inputs (the generator step of a GAN)."""
        validation.check_set_up_modules(modules, "frozen")
        for m in modules:
            m.__dict__["_frozen"] = True
        try:
            with frozen_parameters([m.module for m in modules]):
                yield
        finally:
            for m in modules:
                m.__dict__["_frozen"] = False

    # --- checkpoints (core/state.py) ---------------------------------------------------------------
    def save(self, path, state: dict, background: bool = False) -> Future | None:
        """Save set-up modules, optimizers and plain values (numbers, strings, tensors, containers) in
        one checkpoint, atomically. Every process must call it. `background=True`: return once the state is
        copied, with a Future of the write, which goes on in a thread (core/checkpoint/background.py); the next
        save or load, or `wait_for_save()`, waits for it first and raises what it raised."""
        return self._checkpoints.save(path, state, background)

    def wait_for_save(self) -> None:
        """Wait for the background save running, if any, and raise what it raised (every rank together)."""
        self._checkpoints.saves.wait()

    def load(self, path, state: dict | None = None, strict: bool = True, weights_only: bool | None = None) -> dict:
        """Restore `state`'s modules and optimizers in place, and its plain values; return what the
        checkpoint holds beyond `state` (everything, when `state` is None). Reads what Fabric.save wrote
        (core's or Lightning's) and any dict of state dicts saved with torch.save. Files are read with
        weights_only=True unless `weights_only=False` says the file is trusted (it may hold other pickled
        objects, an argparse.Namespace say, whose loading runs code from the file)."""
        return self._checkpoints.load(path, state, strict, weights_only)
