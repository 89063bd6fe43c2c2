"""What `Fabric.setup` hands back: a wrapped module and a wrapped optimizer (the data loader's: `core/loaders.py`).

Each call takes one route: a set-up module's call is FabricModule.forward (the strategy wrapper under the
precision's mode; the original module while frozen), a marked method is that forward with the method standing in,
and a set-up optimizer's step is its OptimizerStep.
"""
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from core.errors import CoreRuntimeError, CoreTypeError, CoreValueError
from core.nested import map_nested
from core.shared import resolve, share

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")  # a LightningModule's


class BackwardState:
    """Shared by a Fabric and the optimizers it sets up: whether a plain `loss.backward()` would skip work that
    `fabric.backward` does (an engine's backward, a loss scaler), and how many times fabric.backward has run.
    Where it is required, each set-up optimizer's step checks that fabric.backward ran since its last step (the
    count compared with the one it saw at its last step: no hook on any output)."""

    def __init__(self, required: bool = False, scaled_only: bool = False):
        self.required, self.count = required, 0
        self.scaled_only = scaled_only  # the strategy's backward is the loss's own: only a scaler needs fabric.backward

    def missing(self) -> RuntimeError:
        """The error of an optimizer that found no fabric.backward since its last step."""
        return CoreRuntimeError("optimizer.step() found no fabric.backward(loss) since its last step: loss.backward() "
                                "was called where this strategy or precision needs fabric.backward(loss) (DeepSpeed's "
                                "engine runs the backward, 16-mixed scales the loss). Replace loss.backward() with "
                                "fabric.backward(loss).")


class OptimizerStep:
    """What a set-up optimizer's `step(closure)` runs: where the strategy or precision needs fabric.backward (an
    engine's backward, a loss scaler), the check that it ran since this optimizer's last step; then the strategy's
    step (the precision's: through the loss scaler, if any). An object rather than a closure, so that a copy of the
    set-up optimizer (`copy.deepcopy`, pickle) steps the copied optimizer, through the same Fabric."""

    def __init__(self, optimizer, module, strategy, backward: BackwardState):
        self.optimizer, self.module, self.strategy, self.backward = optimizer, module, strategy, backward
        self.seen = backward.count  # fabric.backward's count at this optimizer's last step

    def __call__(self, closure=None):
        if closure is not None:  # a closure runs its own fabric.backward inside the step
            return self.strategy.optimizer_step(self.optimizer, self.module, closure=closure)
        backward = self.backward
        if backward.required and backward.count == self.seen:
            raise backward.missing()
        self.seen = backward.count
        return self.strategy.optimizer_step(self.optimizer, self.module)

    def __getstate__(self):
        refusal = self.module.__dict__.get("_uncopyable")  # before the optimizer and the module are copied
        if refusal:
            raise CoreRuntimeError(refusal)
        return share(self.__dict__, "strategy", "backward")

    def __setstate__(self, state):
        self.__dict__.update(resolve(state, "strategy", "backward"))


class FabricModule(nn.Module):
    """A set-up module. Calling it runs the strategy wrapper (DDP, DeepSpeed engine, ...) under the
    precision context; `.module` is the original. To its user it is the original module: hooks
    registered on it fire, and `state_dict`, `named_parameters`, `.device` and `.dtype` are the original's."""

    def __init__(self, forward_module: nn.Module, original_module: nn.Module, precision, guard: bool,
                 uncopyable: str | None = None):
        """`uncopyable`: why the strategy cannot copy this module (it was sharded or put in an engine in place);
        a deep copy or pickle then raises it. None: copies act on themselves."""
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module
        d = self.__dict__  # plain attributes, kept out of nn.Module's bookkeeping for speed
        # the mode's function of the strategy wrapper, and of the original (called while frozen), decided once: in
        # 32-true the module itself; read per call without nn.Module's lookup
        d["_target"] = precision.forward_of(forward_module)
        d["_original"] = d["_target"] if forward_module is original_module else precision.forward_of(original_module)
        d["_frozen"] = False
        d["_running"] = 0  # 1 while this wrapper's own forward runs with its guards lifted
        d["_uncopyable"] = uncopyable
        d["_guards"] = []
        if guard:  # the module itself too: a method that is not marked may call `self(x)`
            d["_guards"].append(_SubmoduleGuard(self, None, original_module))
            for name, child in original_module.named_children():
                d["_guards"].append(_SubmoduleGuard(self, name, child))
        for name in STEP_METHODS:  # a LightningModule-style step runs the model: route it like forward
            if callable(getattr(type(original_module), name, None)):
                self.mark_forward_method(name)
        d["_ready"] = True  # from here on, attributes set on the wrapper go to the original module

    def __getstate__(self):  # copy.deepcopy and pickle
        if self.__dict__.get("_uncopyable"):
            raise CoreRuntimeError(self.__dict__["_uncopyable"])
        return super().__getstate__()

    def __setstate__(self, state):
        super().__setstate__(state)
        for guard in self.__dict__["_guards"]:  # the copy's guards (in its children's hooks) guard it
            guard.wrapper = weakref.ref(self)
        for marked in self.__dict__.values():  # and its marked methods call it, without keeping it alive
            if isinstance(marked, MarkedMethod):
                marked.wrapper = weakref.ref(self)

    def __setattr__(self, name: str, value) -> None:
        """`model.scale = 0.5` on a set-up module sets it on the original module, which its forward reads; an
        attribute both have (`training`) is set on both."""
        if not self.__dict__.get("_ready"):
            return super().__setattr__(name, value)
        original = self._original_module
        own = name in dir(self)
        if own:
            super().__setattr__(name, value)
        if hasattr(original, name) or not own:
            setattr(original, name, value)

    def forward(self, *args, **kwargs):
        d = self.__dict__
        target = d["_original"] if d["_frozen"] else d["_target"]
        if not d["_guards"] or d["_running"]:  # no guards, or lifted already (a nested call: `self(x)` in a method)
            return target(*args, **kwargs)
        for guard in d["_guards"]:  # inside, the children run on nn.Module's fast path, hook-free
            guard.lift()
        d["_running"] = 1
        try:
            return target(*args, **kwargs)
        finally:
            d["_running"] = 0
            for guard in d["_guards"]:
                guard.restore()

    @property
    def module(self) -> nn.Module:
        return self._original_module

    @property
    def device(self) -> torch.device:
        """The device of the module's first parameter or buffer (CPU for a module with neither)."""
        tensor = next(self._original_module.parameters(), None)
        if tensor is None:
            tensor = next(self._original_module.buffers(), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's first floating-point parameter (float32 for a module with none)."""
        return next((p.dtype for p in self._original_module.parameters() if p.is_floating_point()), torch.float32)

    def mark_forward_method(self, name) -> None:
        """Route `wrapped.<name>(...)` through the strategy wrapper, like a call of the module. `name`: the
        method's name, or the method itself (`model.generate`, of the set-up module or the original)."""
        if callable(name) and not isinstance(name, str):
            owner = getattr(name, "__self__", None)
            if owner is not self and owner is not self._original_module:
                kind = type(self._original_module).__name__
                raise CoreValueError(f"mark_forward_method takes a method of this model ({kind}), got {name!r}; pass "
                                     f"the method's name or `model.method`.")
            name = name.__name__
        if not isinstance(name, str):
            raise CoreTypeError(f"mark_forward_method takes a method or its name, got {name!r}.")
        if not callable(getattr(self._original_module, name, None)):
            raise AttributeError(f"{type(self._original_module).__name__} has no method {name!r} to mark.")
        if name == "forward":
            raise CoreValueError("forward already goes through the wrapper; mark other methods only.")
        self.__dict__[name] = MarkedMethod(self, name)  # beats nn.Module's own methods of the same name

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):  # the wrapper's own protocol (`__deepcopy__` of a
                raise  # sharded original would copy the original, not this wrapper)
            return getattr(self._original_module, name)

    def state_dict(self, *args, **kwargs):
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._original_module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._original_module.named_buffers(prefix, recurse, remove_duplicate)


def uncopyable(strategy: str) -> str:
    """Why a module set up under `strategy`, which shards it or puts it in an engine in place, cannot be copied."""
    return (f"A model set up under strategy={strategy!r} cannot be copied or pickled: the strategy changed it in place "
            f"(its parameters are shards, or live in an engine, tied to this run's processes). For an EMA, teacher or "
            f"snapshot model, copy the module before fabric.setup and set the copy up too, or keep an average of the "
            f"set-up model's own parameters in place of a copy; for its weights, use fabric.save or "
            f"model.state_dict().")


class MarkedMethod:
    """`wrapped.<name>(...)` of a method marked with `mark_forward_method`: the call runs through the strategy
    wrapper's forward, with the original module's forward standing in for the method for that one call. An object
    holding the wrapper and the name rather than a closure over the method, so that a copy of the set-up module
    (`copy.deepcopy`, pickle) calls the copy's own method."""

    def __init__(self, wrapper: FabricModule, name: str):
        self.wrapper = weakref.ref(wrapper)  # stored on the wrapper: a strong reference would be a cycle
        self.name = name

    def __getstate__(self):
        return {"wrapper": self.wrapper(), "name": self.name}

    def __setstate__(self, state):
        # a copy of the method alone holds its copy of the wrapper; where the copy is its wrapper's own,
        # FabricModule.__setstate__ makes the reference weak again
        wrapper = state["wrapper"]
        self.wrapper, self.name = (lambda: wrapper), state["name"]

    def __call__(self, *args, **kwargs):
        wrapper = self.wrapper()
        original = wrapper._original_module
        method = getattr(original, self.name)
        own_forward = original.__dict__.get("forward")  # a forward set on the instance by its user

        def put_back():
            if own_forward is None:
                original.__dict__.pop("forward", None)
            else:
                original.__dict__["forward"] = own_forward

        def once(*inner_args, **inner_kwargs):
            put_back()  # inside the method, `self(...)` is the module's own forward again
            return method(*inner_args, **inner_kwargs)
        original.__dict__["forward"] = once  # the strategy wrapper calls the module, which runs `once`
        try:
            return FabricModule.forward(wrapper, *args, **kwargs)
        finally:
            put_back()


def _dead():  # a guard's reference to a set-up module that is gone
    return None


class _SubmoduleGuard:
    """Forward pre-hook on a module wrapped for gradient sync and on each of its children (`name` None: the
    module itself): called outside the wrapper (`ae.encoder(x)`, or an unmarked method's `self(x)`) while
    gradients are recorded, it would silently skip the sync."""

    def __init__(self, wrapper: FabricModule, name: str, child: nn.Module):
        self.wrapper, self.name = weakref.ref(wrapper), name  # the child must not keep the wrapper alive
        self.id = child.register_forward_pre_hook(self).id
        self.hooks = child._forward_pre_hooks

    def __getstate__(self):
        """A copy is dead (it removes itself at its first call) unless a copy of its set-up module re-points it
        (FabricModule.__setstate__): a copy of the original module alone (`copy.deepcopy(model.module)`, an EMA)
        is a plain module, and copying it must not copy the wrapper."""
        return {**self.__dict__, "wrapper": None}

    def __setstate__(self, state):
        self.__dict__.update(state, wrapper=_dead)

    def lift(self) -> None:
        """Out of the child's hooks while the wrapper's forward runs (a hook, even one that returns at once,
        takes nn.Module's slow call path)."""
        self.hooks.pop(self.id, None)

    def restore(self) -> None:
        self.hooks[self.id] = self

    def __call__(self, module, args):
        wrapper = self.wrapper()
        if wrapper is None:  # the set-up module is gone; the original is a plain module again
            self.hooks.pop(self.id, None)
            return
        # allowed: without gradients, and in backward (activation checkpointing runs the child's forward again
        # there); inside the wrapper's forward the guard is lifted
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        kind = type(wrapper._original_module).__name__
        what, call = (f"The set-up {kind}", "model.module(x)") if self.name is None else \
            (f"Submodule {self.name!r} of the set-up {kind}", f"model.{self.name}(x)")
        raise CoreRuntimeError(
            f"{what} was called outside its distributed wrapper (as `{call}`, or inside a method that is not "
            f"marked), so its gradients would not be synchronised across processes. Call the set-up model "
            f"itself, or route the method through the wrapper with `model.mark_forward_method('name')`. Calls "
            f"under `torch.no_grad()` are allowed.")


class FabricOptimizer:
    """The user's optimizer, by delegation: mixed into a subclass of the optimizer's class, so that
    `isinstance(opt, type(original))` holds and the class's methods run, but every attribute an instance holds
    (`param_groups`, `state`, `defaults`, hooks) is read from and written to the original; the wrapper holds only
    the original and the function its `step` calls. Nothing is copied, so nothing goes stale (`load_state_dict`
    rebinds the original's `state`). `step` is a method of the class, so an LR scheduler built on the wrapper
    can wrap it as it wraps any optimizer's (it sets an instance `step`, which the wrapper keeps)."""

    _own = frozenset({"_optimizer", "_step", "step"})  # what the wrapper itself holds; all else is the original's

    def __init__(self):  # never called: instances are made by wrap_optimizer
        raise CoreTypeError("use Fabric.setup_optimizers to wrap an optimizer")

    def __getattr__(self, name):  # only for what neither the instance nor the class has
        try:
            original = self.__dict__["_optimizer"]
        except KeyError:  # not made by wrap_optimizer (being unpickled)
            raise AttributeError(name) from None
        return getattr(original, name)

    def __setattr__(self, name, value):
        if name in self._own:
            self.__dict__[name] = value
        else:
            setattr(self.__dict__["_optimizer"], name, value)

    def __delattr__(self, name):
        if name in self._own:
            del self.__dict__[name]
        else:
            delattr(self.__dict__["_optimizer"], name)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure=None):
        return self.__dict__["_step"](closure) if closure is not None else self.__dict__["_step"]()

    def zero_grad(self, *args, **kwargs) -> None:  # as the original takes them (some take no set_to_none)
        self._optimizer.zero_grad(*args, **kwargs)

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._optimizer.add_param_group(param_group)

    def __reduce__(self):
        """Copied and pickled as its optimizer and step (both copied): its class is made at run time, and what
        else an instance holds (a step an LR scheduler patched in) is left behind, as torch's Optimizer leaves it."""
        return _rewrap, (self._step, self._optimizer)  # the step first: it refuses a copy before any is made

    def __repr__(self):
        return f"Fabric{self._optimizer!r}"


_optimizer_classes: dict[type, type] = {}


def _rewrap(step, optimizer: torch.optim.Optimizer) -> "FabricOptimizer":
    return wrap_optimizer(optimizer, step)


def wrap_optimizer(optimizer: torch.optim.Optimizer, step) -> FabricOptimizer:
    """Return a FabricOptimizer whose `step(closure)` calls `step` (an OptimizerStep); `optimizer` itself is
    untouched."""
    cls = type(optimizer)
    wrapped_cls = _optimizer_classes.get(cls)
    if wrapped_cls is None:
        wrapped_cls = _optimizer_classes[cls] = type(f"Fabric{cls.__name__}", (FabricOptimizer, cls), {})
    wrapped = wrapped_cls.__new__(wrapped_cls)
    wrapped.__dict__.update(_optimizer=optimizer, _step=step)
    return wrapped


def unwrap_compiled(module: nn.Module):
    """(the module inside a `torch.compile`d one, the compiled one), or (module, None) for a plain module."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        return module._orig_mod, module
    return module, None


def compile_like(module: nn.Module, compiled: nn.Module) -> nn.Module:
    """`module` compiled with the settings (backend, mode, dynamic, fullgraph) of `compiled`, so that the
    strategy's wrapper is what torch.compile traces."""
    from torch._dynamo.eval_frame import OptimizedModule
    return OptimizedModule(module, compiled.dynamo_ctx)


def move_to(obj, device: torch.device):
    """Tensors and modules moved to `device`, also inside lists, tuples (named ones too) and dicts."""
    # host -> GPU copies are queued on the current stream, so they may return before the copy ends (from pinned
    # memory it overlaps the next work); copies to the host stay blocking: the host reads their values next
    non_blocking = device.type == "cuda"
    return map_nested(obj, lambda leaf: leaf.to(device, non_blocking=non_blocking)
                      if isinstance(leaf, (torch.Tensor, nn.Module)) else leaf)


@contextmanager
def frozen_parameters(modules):
    """Turn off requires_grad on every parameter of `modules` that has it, and restore it after."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
