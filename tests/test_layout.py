"""The shape of the suite is part of its promise: the plain and the wrapped script of each workload
differ only where core replaces something, and the files keep to their roles."""
import ast
import difflib
import io
import re
import tokenize
from pathlib import Path

import pytest

from benchmarks.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
# The sdiff promise, as a check: every changed line between a workload's train_torch.py and train.py (comments and
# blank lines stripped) is something core replaces. A plain line is admitted by REWRITES when rewriting it gives a
# changed line of train.py (both are then admitted), otherwise a line must match a pattern of its own side.
REWRITES = [  # (what core replaces, the plain script's form, train.py's form), applied to stripped lines
    ("setup moves the model to the device", r"\)\.to\(device\)$", ")"),
    ("the set-up module is the model: no .module to reach through", r'getattr\((\w+), "module", \1\)', r"\1"),
    ("the set-up module is the model: no .module to freeze", r"\bfrozen_discriminator\(", "discriminator("),
    ("loading a checkpoint", r"\bload_plain\((.*), device\)", r"fabric.load(\1)"),
    ("saving a checkpoint (every rank calls it, rank 0 writes)", r"\bsave_plain\(", "fabric.save("),
    ("backward", r"^(\w+)\.backward\(\)$", r"fabric.backward(\1)"),
    ("a gradient for a penalty", r"\btorch\.autograd\.grad\((.*), create_graph=True\)", r"fabric.grad(\1)"),
    ("a collective", r"\bdist\.all_reduce if world_size > 1 else None\b", "fabric.all_reduce"),
    ("a broadcast returns the object itself", r"\bfid\[0\]", "fid"),
    ("the run directory agreed across ranks through core's collectives (plain: rank 0 alone decides and writes)",
     r"write=rank == 0, resume=", "write=rank == 0, collectives=fabric, resume="),
    ("the CLI entry adds core's flags", r'^cli\(main, Config, prog="python -m (\w+)\.train_torch"',
     r'cli(main, Config, FabricFlags, prog="python -m \1.train"'),
]
ONE_SIDED = {  # (what core replaces, a line only that variant writes for it)
    "-": [
        ("the docstring's commands", r'^"""|^(python|torchrun) '),
        ("imports", r"^import os$|^from contextlib import nullcontext$|^import torch\.distributed as dist$|"
                    r"^from torch\.nn\.parallel import DistributedDataParallel$|^from common\.plain_checkpoint import"),
        ("rank, device and process group", r'^(rank, world_size|local_rank) = int\(os\.environ|'
                                           r'^device = torch\.device\(|^if device\.type == "cuda":$|'
                                           r"^torch\.cuda\.set_device\(device\)$|"
                                           r"^dist\.(init|destroy)_process_group\("),
        ("tearing the process group down on every way out", r"^try:$|^finally:$|"
                                                            r"^return train\(config, rank, world_size, device\)$|"
                                                            r"^def train\(config: Config, rank: int, world_size: int, "
                                                            r"device: torch\.device\) -> dict:$"),
        ("what only a distributed run does", r"^if world_size > 1:$"),
        ("only rank 0 writes a checkpoint", r"^if rank == 0:$"),
        ("the DDP wrapper", r"^\w+ = DistributedDataParallel\("),
        ("setup_dataloaders moves each batch", r"^\w+ = \w+\.to\(device, non_blocking=True\)$"),
        ("no_backward_sync", r"^with \w+\.no_sync\(\) if world_size > 1 and .* else nullcontext\(\):$"),
        ("frozen: the DDP module's parameters turned off by hand",
         r"^frozen_discriminator = discriminator\.module if world_size > 1 else discriminator$|"
         r"^frozen_discriminator\.requires_grad_\((False|True)\)$"),
        ("a broadcast", r"^fid = \[evaluate\(.*\)\]$|^dist\.broadcast_object_list\(fid\)$"),
        ("the periodic save, which train.py may leave to the background", r'^save_plain\(run\.checkpoint, state\)$|'
                                                                          r'^run\.keep_checkpoint\(state\["step"\]\)$'),
    ],
    "+": [
        ("the docstring's commands", r'^"""|^python -m \w+\.train\b'),
        ("imports", r"^from core import Fabric$|^from core\.cli import FabricFlags$"),
        ("rank, device and process group", r"^fabric = Fabric\(\*\*config\.fabric_options\(\)\)$|^fabric\.launch\(\)$|"
                                           r"^rank, world_size, device = fabric\.global_rank, fabric\.world_size, "
                                           r"fabric\.device$"),
        ("setup: the strategy's wrapper, precision, the optimizer", r"^[\w, ]+ = fabric\.setup\(|^ddp=\{.*\}\)$"),
        ("setup_dataloaders", r"^loader = fabric\.setup_dataloaders\(loader\)$"),
        ("a method besides forward routed through the wrapper (plain: through .module)",
         r'^\w+\.mark_forward_method\("\w+"\)$'),
        ("no_backward_sync", r"^with fabric\.no_backward_sync\("),
        ("frozen", r"^with fabric\.frozen\(\w+\):$"),
        ("a broadcast", r"^fid = fabric\.broadcast\("),
        ("the periodic save in the background where asked (--save-in-background), kept once written",
         r"^saving = fabric\.save\(run\.checkpoint, state, background=config\.save_in_background\)$|"
         r'^run\.keep_checkpoint\(state\["step"\], after=saving\)$'),
    ],
}


def admitted(changed: list[str]) -> list[str]:
    """The changed lines the allow-list does not admit (empty: every one is something core replaces)."""
    plain = [line[1:].strip() for line in changed if line[0] == "-"]
    wrapped = [line[1:].strip() for line in changed if line[0] == "+"]
    left = []
    for line in plain:
        rewritten = line
        for _, pattern, replacement in REWRITES:
            rewritten = re.sub(pattern, replacement, rewritten)
        if rewritten != line and rewritten in wrapped:
            wrapped.remove(rewritten)
        elif not any(re.search(pattern, line) for _, pattern in ONE_SIDED["-"]):
            left.append(f"train_torch.py: {line}")
    left += [f"train.py: {line}" for line in wrapped if not any(re.search(p, line) for _, p in ONE_SIDED["+"])]
    return left


def code_lines(path: Path) -> list[str]:
    """Source lines without comments and blank lines (docstrings count: they hold each script's commands)."""
    source = path.read_text()
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.start[1]
    lines = []
    for number, line in enumerate(source.splitlines(), 1):
        if number in comments:
            line = line[:comments[number]]
        if line.strip():
            lines.append(line.rstrip())
    return lines


def changed_lines(a: Path, b: Path) -> list[str]:
    diff = difflib.unified_diff(code_lines(a), code_lines(b), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_every_line_the_sdiff_shows_is_something_core_replaces(workload):
    changed = changed_lines(ROOT / workload / "train_torch.py", ROOT / workload / "train.py")
    assert not admitted(changed), "not something core replaces (tests/test_layout.py's REWRITES and ONE_SIDED):\n" + \
        "\n".join(admitted(changed))


def test_the_allow_list_refuses_a_line_core_does_not_replace():
    plain = ["-    model = Model().to(device)", "-        loss.backward()", "-    if world_size > 1:"]
    wrapped = ["+    model = Model()", "+        fabric.backward(loss)"]
    assert admitted(plain + wrapped) == []
    assert admitted(plain + wrapped + ["+    lr = lr * 2"]) == ["train.py: lr = lr * 2"]
    assert admitted(["-    model = Model().to(device)", "+    model = Model(width=2)"]) == [
        "train_torch.py: model = Model().to(device)", "train.py: model = Model(width=2)"]  # a rewrite must match


def test_every_entry_of_the_allow_list_admits_a_line_of_some_workload():
    """The list says what core replaces today: an entry no script needs any more goes."""
    changed = [line for w in WORKLOADS for line in changed_lines(ROOT / w / "train_torch.py", ROOT / w / "train.py")]
    unused = [reason for reason, pattern, _ in REWRITES if not any(re.search(pattern, line[1:].strip())
                                                                   for line in changed if line[0] == "-")]
    unused += [f"{side} {reason}" for side, entries in ONE_SIDED.items() for reason, pattern in entries
               if not any(re.search(pattern, line[1:].strip()) for line in changed if line[0] == side)]
    assert not unused


def test_every_workload_is_registered():
    """A workload is a folder with both scripts, and benchmarks/workloads.py knows it."""
    folders = {path.parent.name for path in ROOT.glob("*/train_torch.py") if (path.parent / "train.py").is_file()}
    assert folders == set(WORKLOADS)


def test_the_budget_counter_counts_code_not_comments(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('"""doc"""\nx = 1  # one\n\ny = 2\n')
    b.write_text('"""doc"""\nx = 1  # uno\n# new comment\n\n\ny = 3\n')
    assert changed_lines(a, b) == ["-y = 2", "+y = 3"]


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_files_keep_to_their_roles(workload):
    folder = ROOT / workload
    plain, wrapped = imports(folder / "train_torch.py"), imports(folder / "train.py")
    assert not any(name == "core" or name.startswith("core.") for name in plain), "the plain variant imports core"
    assert "core" in wrapped
    assert not any(name.startswith("torch.distributed") for name in wrapped), "distribution belongs in core"
    for both in (plain, wrapped):  # model and data are imported by both scripts, never copied
        assert f"{workload}.model" in both
    for path in folder.glob("*.py"):
        if path.stem not in ("train", "train_torch"):
            assert not any(n.startswith(("core", "torch.distributed")) for n in imports(path)), path.name


def test_common_helpers_are_plain_pytorch():
    for path in (ROOT / "common").glob("*.py"):
        assert not any(n.startswith(("core", "torch.distributed")) for n in imports(path)), path.name


def _package(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_no_workload_imports_another(workload):
    """What two workloads share lives in common/, so each workload folder reads (and can be copied) alone."""
    others = set(WORKLOADS) - {workload}
    for path in (ROOT / workload).glob("*.py"):
        assert not {_package(name) for name in imports(path)} & others, f"{workload}/{path.name}"


def test_common_imports_no_workload():
    for path in (ROOT / "common").glob("*.py"):
        assert not {_package(name) for name in imports(path)} & set(WORKLOADS), path.name


def module_graph() -> dict[str, set[str]]:
    """module -> the suite's modules it imports (lazy imports inside functions included). `from pkg import mod`
    counts as an import of pkg.mod where that is a module, else of pkg."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for top in ("core", "common", "gan", "autoencoder", "metalearn", "benchmarks")
             for p in (ROOT / top).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                            for alias in node.names}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def test_no_import_circle_and_no_module_imports_a_package_above_it():
    graph = module_graph()
    for name, targets in graph.items():
        upward = [t for t in targets if name.startswith(t + ".")]
        assert not upward, f"{name} imports {upward}, a package it is part of"

    def reaches(start, goal, seen):
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)) for t in graph[start])
    circles = sorted(name for name in graph if reaches(name, name, set()))
    assert not circles, f"modules in an import circle: {circles}"


def test_every_file_opens_with_a_docstring():
    for folder in ("core", "common", "gan", "autoencoder", "metalearn", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            assert ast.get_docstring(ast.parse(path.read_text())), path


def stated_targets(text: str) -> set[tuple[str, str]]:
    """The bounds a text states as targets: "target >= 33", "The target, `workloads.py`'s, is <= 0.38"."""
    text = " ".join(text.split())
    return set(re.findall(r"[Tt]argets?\b[^<>;]{0,60}?([<>]=) ?(\d+(?:\.\d+)?)", text))


def test_stated_targets_are_read_wherever_the_sentence_puts_them():
    assert stated_targets("(target >= 33 dB over 3 seeds)") == {(">=", "33")}
    assert stated_targets("The target, `benchmarks/workloads.py`'s, is\n<= 0.38 over 3 seeds.") == {("<=", "0.38")}
    assert stated_targets("an earlier target was 0.40, which the paragraphs below measured against") == set()


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_workload_readmes_state_the_registrys_quality_targets(workload):
    """A workload README states each of its quality targets as benchmarks/workloads.py (their one source) holds
    it, and no other: a target changed on either side alone fails here."""
    registry = {tuple(q.target.split()) for q in WORKLOADS[workload].quality}
    assert stated_targets((ROOT / workload / "README.md").read_text()) == registry



# core's layers, bottom up: a module imports only from its own layer or the ones below (the longest name that
# prefixes a module places it). Adding a strategy or a precision touches its own file and its table's line.
CORE_LAYERS = [
    ["core.errors", "core.shared", "core.seed", "core.nested", "core.checkpoint.files", "core.checkpoint.integrity",
     "core.checkpoint.space", "core.checkpoint.names", "core.precision"],  # leaves
    ["core.wrappers", "core.optimizers", "core.loaders"],  # what setup hands back: FabricModule, FabricOptimizer, FabricDataLoader
    ["core.checkpoint"],  # the formats behind one table (one file, sharded, DeepSpeed)
    ["core.launcher"],  # starting, watching and ending the processes
    ["core.strategies"],  # one class per file behind STRATEGIES
    ["core.validation"],  # the checks behind Fabric's errors
    ["core.state", "core.collectives", "core.fabric"],  # the Fabric (what the workloads use), and its objects in and out of checkpoints
    ["core", "core.cli", "core.convert"],  # the entry points
    ["core.compat"],  # the Lightning drop-in, on top of the rest: what core offers ported scripts beyond the workloads
]


def core_layer(module: str) -> int:
    matches = [(len(prefix), level) for level, prefixes in enumerate(CORE_LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer of CORE_LAYERS: add it there"
    return max(matches)[1]


CORE_FILE_LINES = 320  # "no file much over ~300" (../STYLE's layout): a file that grows past it splits by concern


def test_no_core_file_is_much_over_300_lines():
    long = {str(path.relative_to(ROOT)): n for path in (ROOT / "core").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > CORE_FILE_LINES}
    assert not long, f"core files over {CORE_FILE_LINES} lines: {long}; split each by concern (docs/core.md's layout)"


def test_core_imports_only_from_its_own_layer_or_below():
    graph = module_graph()
    upward = [f"{name} -> {target}" for name, targets in graph.items() if name.split(".")[0] == "core"
              for target in targets if core_layer(target) > core_layer(name)]
    assert not upward, f"imports from a higher layer of core: {upward}"


def test_no_strategy_internals_outside_core():
    """What a process holds of a sharded parameter is the strategy's to say (its `parameter_shares`): common/ and
    the workloads never read ZeRO's or DTensor's internals, nor core's file conventions."""
    internals = re.compile(r"ds_tensor|ds_numel|ds_shape|\.partition\(|to_local|full_tensor|DTensor|"
                           r"core-checkpoint|_core_checkpoint|\.old\b|state\.pt")
    for top in ("common", *WORKLOADS):
        for path in (ROOT / top).rglob("*.py"):
            found = [line.strip() for line in path.read_text().splitlines() if internals.search(line.split("#")[0])]
            assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_the_workloads_configs_state_needs_and_name_no_strategy():
    """A workload says what it needs (`needs()`, core.strategies.NEEDS) and core decides what a strategy can do: no
    workload config names a strategy, its options or its stages (contiguous_gradients, ZeRO-3, deepspeed*)."""
    strategy_words = re.compile(r"deepspeed|zero_optimization|contiguous_gradients|ZeRO|fsdp|\bddp\b", re.I)
    for workload in WORKLOADS:
        code = "\n".join(code_lines(ROOT / workload / "config.py"))
        assert not strategy_words.findall(code), f"{workload}/config.py: {strategy_words.findall(code)}"


def test_the_readmes_sdiff_column_is_the_count_of_the_scripts():
    """The README's "changed lines" column is what changed_lines counts now (each line admitted above)."""
    rows = re.findall(r"^\| \[`(\w+)`\]\(\w+/README\.md\) \|.*\| (\d+) \|$", (ROOT / "README.md").read_text(), re.M)
    counts = {w: len(changed_lines(ROOT / w / "train_torch.py", ROOT / w / "train.py")) for w in WORKLOADS}
    assert {w: int(n) for w, n in rows} == counts


def test_the_workloads_run_on_core_without_the_lightning_drop_in():
    """core.compat (callbacks, loggers, `fabric run`, Lightning's other strategy names) is a layer on top: nothing
    the workloads import reaches it, so core without it is what a GAN, an autoencoder and MAML need."""
    graph = module_graph()

    def reached(name, seen):
        for target in graph[name]:
            if target not in seen:
                seen.add(target)
                reached(target, seen)
        return seen
    for workload in WORKLOADS:
        for script in ("train", "train_torch"):
            drop_in = sorted(m for m in reached(f"{workload}.{script}", set()) if m.split(".")[:2] == ["core", "compat"])
            assert not drop_in, f"{workload}.{script} reaches the Lightning drop-in: {drop_in}"


def test_core_raises_its_own_errors():
    """A refusal core raises is a CoreError (its subclasses are still ValueError, TypeError and RuntimeError), so a
    caller and the contract test can tell it from a crash; the Lightning drop-in keeps Lightning's plain ones."""
    bare = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        if "compat" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            raised = node.exc if isinstance(node, ast.Raise) else node.value if isinstance(node, ast.Return) else None
            if isinstance(raised, ast.Call) and isinstance(raised.func, ast.Name) and \
                    raised.func.id in ("ValueError", "TypeError", "RuntimeError"):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno} {raised.func.id}")
    assert not bare, f"raise core's own error (core.errors) instead: {bare}"


# what of core's own protected names the Lightning drop-in may use: the extension points docs/core.md lists ("How
# core is built", fabric.py); any other name of core's that starts with "_" is core's to change
EXTENSION_POINTS = {"_after_setup", "_step_function", "_launched", "_check_launched", "_start_distributed",
                    "_checkpoints"}


def protected_names(tree) -> set[str]:
    """The protected names a module defines: functions, classes, module variables, and attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def test_the_drop_in_reaches_core_only_through_public_names_and_its_extension_points():
    core_files = [p for p in (ROOT / "core").rglob("*.py") if "compat" not in p.parts]
    core_own = set().union(*(protected_names(ast.parse(p.read_text())) for p in core_files))
    reached = []
    for path in sorted((ROOT / "core" / "compat").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            used = [node.attr] if isinstance(node, ast.Attribute) else \
                [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            reached += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in used
                        if name in core_own and name not in EXTENSION_POINTS]
    assert not reached, f"the drop-in uses core's protected names beyond its extension points: {reached}"
