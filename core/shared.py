"""How a set-up object refers to its Fabric's shared parts (the strategy, the precision with its loss scaler, the
backward count) when it is copied or pickled: a copy of a set-up model or optimizer is a new model or optimizer run
by the same Fabric, as a copy of a plain model and optimizer still goes through the user's one GradScaler. So
`copy.deepcopy` and a pickle round trip in the same process keep these parts shared (by reference); unpickled in
another process, where that Fabric does not exist, a set-up object is refused with what to do instead."""
import itertools
import os
import weakref

from core.errors import CoreRuntimeError

_live = weakref.WeakValueDictionary()  # token -> a shared part, while it lives
_tokens = itertools.count()


class SharedRef:
    """What a copy or pickle holds in place of a shared part: its process and token."""

    __slots__ = ("pid", "token", "kind")

    def __init__(self, part):
        token = part.__dict__.get("_shared_token")
        if token is None:
            token = part.__dict__["_shared_token"] = next(_tokens)
        _live[token] = part
        self.pid, self.token, self.kind = os.getpid(), token, type(part).__name__

    def __getstate__(self):
        return self.pid, self.token, self.kind

    def __setstate__(self, state):
        self.pid, self.token, self.kind = state

    def resolve(self):
        part = _live.get(self.token) if self.pid == os.getpid() else None
        if part is None:
            raise CoreRuntimeError(
                f"This set-up model or optimizer was pickled in process {self.pid} and runs through that process's "
                f"Fabric ({self.kind}), which this process does not have. Pickle what it holds instead "
                f"(`model.module`, `optimizer.state_dict()`, or fabric.save) and set it up again here.")
        return part


def share(state: dict, *names: str) -> dict:
    """`state` (an object's __getstate__) with the shared parts under `names` replaced by references."""
    return {**state, **{name: SharedRef(state[name]) for name in names}}


def resolve(state: dict, *names: str) -> dict:
    """`state` with the references under `names` (share's) turned back into the live parts."""
    return {**state, **{name: state[name].resolve() for name in names}}
