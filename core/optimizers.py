"""What `Fabric.setup` hands back for an optimizer: the wrapped optimizer, and the step object its `step` runs.

A set-up optimizer's step is one object, OptimizerStep: the check that fabric.backward ran where the strategy or
precision needs it, then the strategy's step. FabricOptimizer is the user's optimizer by delegation.
"""
import torch

from core.errors import CoreRuntimeError, CoreTypeError
from core.shared import resolve, share


class BackwardState:
    """Shared by a Fabric and the optimizers it sets up: whether a plain `loss.backward()` would skip work that
    `fabric.backward` does (an engine's backward, a loss scaler), and how many times fabric.backward has run.
    Where it is required, each set-up optimizer's step checks that fabric.backward ran since its last step (the
    count compared with the one it saw at its last step: no hook on any output)."""

    def __init__(self, required: bool = False):
        self.required, self.count = required, 0

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
