"""Lightning's `fabric run`: it starts every process itself and passes Fabric's arguments in the environment
(LT_CLI_USED=1, LT_ACCELERATOR, LT_STRATEGY, LT_DEVICES, LT_NUM_NODES, LT_PRECISION)."""
import os


def started_by_cli() -> bool:
    """True when Lightning's `fabric run` started this process (it sets LT_CLI_USED=1 and starts the ranks)."""
    return os.environ.get("LT_CLI_USED") == "1"


def from_cli(name: str, given, default):
    """A Fabric argument: as given, else from `fabric run`'s environment (LT_<NAME>), else `default`. A value
    given in the code that contradicts `fabric run`'s command line is an error, not a silent choice of one."""
    value = os.environ.get(f"LT_{name.upper()}")
    if given is not None and str(given) == str(default) and started_by_cli():
        given = None  # under `fabric run`, the default written out does not contradict the command line
    if value is None or (given is not None and not started_by_cli()):
        return default if given is None else given
    if given is not None and str(given) != value:
        raise ValueError(f"The code has Fabric({name}={given!r}) but the command line gives --{name.replace('_', '-')}="
                         f"{value}. Remove one of them.")
    return value
