"""An optimizer's state keyed by parameter name, and back: how every checkpoint format stores an optimizer, so
that it loads under any strategy (which numbers, groups or shards the parameters its own way)."""
from core.errors import CheckpointError


def named_optimizer_state(state: dict, groups: list[list[str]]) -> dict:
    """`optimizer.state_dict()` keyed by parameter name instead of position (the layout of
    torch.distributed.checkpoint: state {name: {...}}, param_groups with "params": [names]), so that it loads
    under any strategy. `groups`: the names of the parameters of each of the optimizer's groups, in order."""
    if all(isinstance(i, str) for group in state["param_groups"] for i in group["params"]):
        return state
    saved = [i for group in state["param_groups"] for i in group["params"]]
    names = [name for group in groups for name in group]
    if len(saved) != len(names):
        raise CheckpointError(f"The checkpoint's optimizer state is for {len(saved)} parameters, the optimizer has "
                              f"{len(names)}. Was it saved with another model or optimizer?")
    name_of = dict(zip(saved, names))  # torch numbers the parameters in the order of their groups
    return {"state": {name_of[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def indexed_optimizer_state(state: dict, groups: list[list[str]], frozen=frozenset()) -> dict:
    """The inverse, as torch.optim's load_state_dict takes it: each name becomes the position of that
    parameter in this optimizer (torch pairs saved and current parameters by position within a group).
    `frozen`: names of weights that do not train here, which a saved group may lack (DeepSpeed's optimizer leaves
    the weights its user froze out; they have no state)."""
    if not all(isinstance(i, str) for group in state["param_groups"] for i in group["params"]):
        return state
    if len(state["param_groups"]) != len(groups):
        raise CheckpointError(f"The checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this "
                              f"one {len(groups)}. Build the optimizer with the groups of the run that saved it.")
    index = {name: i for i, name in enumerate(name for group in groups for name in group)}
    out_groups = []
    for number, (saved, names) in enumerate(zip(state["param_groups"], groups)):
        extra, missing = set(saved["params"]) - set(names), set(names) - set(saved["params"])
        if extra or missing - set(frozen):  # only weights that do not train here may be missing
            differ = sorted(extra | missing)
            raise CheckpointError(f"The checkpoint's optimizer group {number} does not hold the parameters of this "
                                  f"one (differing: {', '.join(differ[:5])}). Was it saved with another model?")
        out_groups.append({**saved, "params": [index[name] for name in names]})
    return {"state": {index[name]: value for name, value in state["state"].items() if name in index},
            "param_groups": out_groups}


def is_optimizer_entry(value) -> bool:
    return isinstance(value, dict) and set(value) == {"optimizer", "scaler"} and \
        isinstance(value["optimizer"], dict) and "param_groups" in value["optimizer"]
