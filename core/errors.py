"""core's own exceptions: every refusal core raises on purpose is one of these, so that a caller (and the contract
test) can tell "core said no, and why" from a crash. Each still subclasses the builtin a user would catch
(`except ValueError` keeps working)."""


class CoreError(Exception):
    """Base of every error core raises on purpose; its message says what was wrong and what to do instead."""


class CoreValueError(CoreError, ValueError):
    """A value core cannot take (an argument, a configuration, a checkpoint)."""


class CoreTypeError(CoreError, TypeError):
    """An object of a type core does not take where it was passed."""


class CoreRuntimeError(CoreError, RuntimeError):
    """A call at a time or in a state where core cannot honour it."""


class CheckpointError(CoreValueError):
    """A checkpoint that cannot be used: missing, corrupt, foreign, unsafe, or not matching the run."""
