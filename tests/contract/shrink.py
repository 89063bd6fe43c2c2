"""Smaller programs than a failing one, for run.shrink: each candidate removes a model or a step, or turns one
option off; the shrinker keeps the first that still fails and starts again from it."""
import copy

STEP_OPTIONS = {"clip": None, "lr_scale": None, "overflow": False, "checkpoint": False, "fresh": False,
                "reload_optimizer": False,
                "no_model": False, "eval": False, "reduce": False, "copy": None, "set_to_none": True}
MODEL_OPTIONS = {"split": False, "norm": False, "frozen": False, "marked": False, "width": 4}
ONE_MODEL_KINDS = ("each", "accumulate", "penalty", "penalty2", "probe")  # what one model can run


def simpler(program: dict):
    """Candidates, roughly largest cut first (each a new program; `expect` is the caller's to set)."""
    models, steps = program["models"], program["steps"]
    if program.get("moved"):
        yield {**copy.deepcopy(program), "moved": None}
    for j in range(len(models)):
        if len(models) > 1:
            yield without_model(program, j)
    for s in range(len(steps)):
        if len(steps) > 1:
            candidate = copy.deepcopy(program)
            del candidate["steps"][s]
            yield candidate
    if program["epochs"] > 1:
        yield {**copy.deepcopy(program), "epochs": 1}
    if program["loader"] != "shuffle":
        yield {**copy.deepcopy(program), "loader": "shuffle"}
    for s, step in enumerate(steps):
        if step["kind"] != "each":
            candidate = copy.deepcopy(program)
            candidate["steps"][s]["kind"] = "each"
            yield candidate
        for name, off in STEP_OPTIONS.items():
            if step[name] != off:
                candidate = copy.deepcopy(program)
                candidate["steps"][s][name] = off
                if name == "checkpoint":
                    candidate["steps"][s].update(reload_optimizer=False, fresh=False)
                yield candidate
    for j, spec in enumerate(models):
        for name, off in MODEL_OPTIONS.items():
            if spec[name] != off:
                candidate = copy.deepcopy(program)
                candidate["models"][j][name] = off
                yield candidate
        for k, optimizer in enumerate(spec["optimizers"]):
            candidate = copy.deepcopy(program)
            del candidate["models"][j]["optimizers"][k]
            if len(candidate["models"][j]["optimizers"]) == 1:  # what is left updates the whole model
                candidate["models"][j]["optimizers"][0]["params"] = "all"
            yield candidate
            for name, off in (("scheduler", None), ("kind", "sgd")):
                if optimizer[name] != off:
                    candidate = copy.deepcopy(program)
                    candidate["models"][j]["optimizers"][k][name] = off
                    yield candidate


def without_model(program: dict, j: int) -> dict:
    candidate = copy.deepcopy(program)
    del candidate["models"][j]
    for spec in candidate["models"]:  # an optimizer shared with the next model needs that model
        spec["optimizers"] = [o for o in spec["optimizers"] if o["params"] != "shared" or len(candidate["models"]) > 1]
    if len(candidate["models"]) == 1:
        for step in candidate["steps"]:
            if step["kind"] not in ONE_MODEL_KINDS:
                step["kind"] = "each"
    return candidate
