"""What `Fabric.setup` hands back for a module (the optimizer's: `core/optimizers.py`; the data loader's:
`core/loaders.py`).

Each call takes one route: a set-up module's call is FabricModule.forward (the strategy wrapper under the
precision's mode; the original module while frozen), and a marked method is that forward with the method standing
in. Under ddp, a guard on each submodule refuses a call that would go around the wrapper.
"""
import weakref
from contextlib import contextmanager

import torch
from torch import nn

from core.errors import CoreRuntimeError, CoreTypeError, CoreValueError


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


def unwrap_compiled(module: nn.Module):
    """(the module inside a `torch.compile`d one, the compiled one), or (module, None) for a plain module."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        return module._orig_mod, module
    return module, None


def compile_like(forward_module: nn.Module, module: nn.Module, compiled: nn.Module, strategy) -> nn.Module:
    """What a set-up module calls for the `torch.compile`d module the user passed: the compiled one itself where
    nothing wraps `module`, else the strategy's wrapper compiled with the same settings (backend, mode, dynamic,
    fullgraph), so that the wrapper is what torch.compile traces."""
    if not strategy.moves_module:
        raise CoreValueError(f"strategy={strategy.name!r} runs the module inside its engine, which torch.compile "
                             f"cannot wrap from outside; set up the uncompiled module.")
    if forward_module is module:
        return compiled
    from torch._dynamo.eval_frame import OptimizedModule
    return OptimizedModule(forward_module, compiled.dynamo_ctx)


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


def module_of_loss(loss: torch.Tensor, modules: list) -> FabricModule:
    """The one module of `modules` whose trainable parameters this loss reaches, found in its autograd graph
    (set-up modules or DeepSpeed engines: each has parameters() and .module)."""
    if len(modules) == 1:
        return modules[0]
    leaves, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    owners = [m for m in modules if any(id(p) in leaves for p in m.parameters())]
    if len(owners) == 1:
        return owners[0]
    names = ", ".join(type(m.module).__name__ for m in owners) or "none"
    raise CoreValueError(f"Cannot tell which set-up model this loss is for: it reaches the parameters of {names}. "
                         f"Pass it: `fabric.backward(loss, model=generator)`, or exclude the other model with "
                         f"`with fabric.frozen(discriminator): ...` around its forward.")
