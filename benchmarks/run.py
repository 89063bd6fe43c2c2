"""Reproduce the suite's numbers: parity, overhead, MAML speed, each workload against this machine, checkpoints and
(full mode) quality.

    python -m benchmarks.run --quick        # about 10 minutes on a 2-core CPU
    python -m benchmarks.run                # full: more steps and repeats, every precision, the quality runs
    python -m benchmarks.run --only overhead,maml

A full run writes benchmarks/results/<name>.md, .json and .png and its tables into benchmarks/README.md; a quick
run writes benchmarks/results/quick/ only, so the committed full results and the tables stay as they are. A
figure that misses its target says so in the table; a peer that is not installed (Lightning, `higher`:
the bench extra) has a row saying so; no row is left out.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

from benchmarks import cadence, evaluation, machine, maml_speed, overhead, paired, parity
from benchmarks.record import (RESULTS, ROOT, environment, paste_into_readme, ratio_chart, results_dir, table,
                               uncommitted, write)
from benchmarks.workloads import WORKLOADS

PARTS = ("overhead", "maml", "machine", "parity", "checkpoint", "cadence", "evaluation", "quality")
# plus each workload's noise floor (A/A rows); only where the plain side runs the same strategy (parity.plain_reference)
NOT_INSTALLED = "not installed: pip install -e '.[bench]'"
MAML_TARGETS = {"per-task autograd loop": 5, "per-task higher loop": 20}  # the learner's speed-up over each
COMPILE_TARGET = 1.3  # meta-iterations/s of the compiled learner over the eager one (issue 17)


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"




def _interval(r: dict) -> str:
    return f"{r['ratio']:.3f} [{r['interval'][0]:.3f}-{r['interval'][1]:.3f}]"


def run_overhead(quick: bool) -> str:
    result = overhead.measure(quick=quick)
    rows, walks = [], []
    for r in result["rows"]:
        clock = overhead.clock_of(r["path"])
        plain = r["ratios"]["core"][clock]["plain_s"] * 1e6
        rows.append([r["path"], "plain", plain, "", clock, "", "", ""])
        for name, ratio in r["ratios"].items():
            verdict = paired.verdict(ratio[clock]["interval"], overhead.target_of(r["path"]))
            rows.append([r["path"], name, ratio[clock]["side_s"] * 1e6, _interval(ratio[clock]), clock,
                         _interval(ratio["wall"]), (ratio[clock]["ratio"] - 1) * plain,
                         f"<= {overhead.target_of(r['path'])}: " + ("**no**" if verdict == "no" else verdict)
                         if name == "core" else ""])
        if "graph_walk_us" in r:
            walks.append(f"{r['path']} {r['graph_walk_us']:.0f} us ({r['graph_walk_us'] / plain:.2%} of the plain "
                         f"step)")
        if r["path"] == "32-true" and "lightning" not in r["ratios"]:
            rows.append(["32-true", "lightning", NOT_INSTALLED, "", "", "", "", ""])
    config = {"quick": quick, "rows": {r["path"]: {"steps_per_block": r["steps"], "rounds": r["rounds"]}
                                       for r in result["rows"]}, "commands": [r["command"] for r in result["rows"]]}
    imports = result["import"]
    markdown = ("Host overhead per step on each path where core does work, against plain PyTorch doing the same "
                "work, 1 thread per process: a 2-layer MLP (batch 8, SGD) in 32-true, bf16-mixed (autocast and "
                "the output cast back to float32, written out in plain), 16-mixed (a GradScaler written out) "
                "and ddp on 2 gloo processes (plain DistributedDataParallel called "
                "directly; core's set-up module and submodule guard around it); each workload's own training step "
                "at its default sizes, train_torch.py's against train.py's (`benchmarks/steps.py`), in 32-true on "
                "one process and under ddp on 2 (plain: the models in DistributedDataParallel as the plain scripts "
                "wrap them); and the GAN's two models "
                "and two optimizers at their default sizes (`benchmarks/two_models.py`) in 16-mixed (one "
                "GradScaler for both) and DeepSpeed ZeRO-2 on one process (two engines, where `fabric.backward` "
                "searches the loss's autograd graph for its model). Each path runs in its own process, plain and wrapped "
                "interleaved in short blocks on the same data, in a seeded random order per round "
                "(`benchmarks/paired.py`). Ratio: the trimmed mean of the rounds' paired ratios, [its 95% "
                "bootstrap interval], on CPU time (of the process; for ddp of the training thread, both ranks' "
                "added up: gloo's own threads poll while a rank waits), and on wall time beside it. "
                f"Verdict on the CPU interval against the row's target ({overhead.TARGETS['mlp']} for the MLP, whose "
                f"sub-millisecond step shows the few microseconds of core's one route per call; "
                f"{overhead.TARGETS['workload']} for a workload's step, what its user pays): yes when it lies "
                f"under, **no** over, "
                "otherwise no verdict with the noise (+- half the interval); `benchmarks/results/calibration.md` "
                "shows what each row can detect. us/step: median CPU time per step of the variant (ddp: both ranks' "
                "training threads); overhead us: "
                "(ratio - 1) x plain.\n\n" +
                table(["path", "variant", "us/step", "ratio, CPU [95%]", "clock", "ratio, wall [95%]", "overhead us",
                       "target: verdict"], rows) +
                (f"\nfabric.backward's search of D's loss graph for its model, timed alone: {'; '.join(walks)}.\n"
                 if walks else "") +
                f"\n`import core` {imports['core_s']['median']:.2f} s vs `import torch` "
                f"{imports['torch_s']['median']:.2f} s: ratio {imports['ratio']:.3f} (target <= 1.10: "
                f"{_mark(imports['ratio'] <= 1.10)})\n\n"
                f"The loops' stop decision, averaged per step (the ranks compare every 10 steps and at each "
                f"loss check, here every 50 steps): "
                f"{result['stop_check']['one_process_us']['median']:.1f} us on one process, "
                f"{result['stop_check']['two_processes_us']['median']:.1f} us on 2 gloo processes "
                f"(one all-reduce).\n\nCommands (each path's process): " +
                ", ".join(f"`{c}`" for c in config["commands"]) + "\n\nChart: `overhead.png` (each ratio with its "
                "interval, against the target).\n")
    write("overhead", config, result["rows"] + [imports, result["stop_check"]], markdown, quick=quick)
    overhead_chart(result["rows"], results_dir(quick))
    return markdown


def overhead_chart(rows: list[dict], directory) -> None:
    """overhead.png: each path's CPU-time ratio (core, and Lightning's where measured) with its 95% interval."""
    labels, spreads, targets = [], [], []
    for r in rows:
        clock = overhead.clock_of(r["path"])
        for name, ratio in r["ratios"].items():
            labels.append(f"{r['path']} {name}")
            spreads.append({"median": ratio[clock]["ratio"], "min": ratio[clock]["interval"][0],
                            "max": ratio[clock]["interval"][1]})
            targets.append(overhead.target_of(r["path"]) if name == "core" else None)
    directory.mkdir(parents=True, exist_ok=True)
    ratio_chart(directory / "overhead.png", labels, spreads, [None] * len(labels),
                "time per step, wrapped / plain (CPU time; ddp: both ranks' training threads)",
                "Host overhead per step, against plain PyTorch doing the same work", targets=targets,
                spread="trimmed mean [95% bootstrap interval]")


def run_maml(quick: bool) -> str:
    iterations, repeats = (100, 3) if quick else (300, 5)
    result = maml_speed.measure(iterations=iterations, repeats=repeats)
    markdown = ""
    for name, setup in result["setups"].items():
        rows = []
        for r in setup["rows"]:
            method, vs_loop, target, met = r["method"], f"{r['speed_vs_loop']:.3g}", "", ""
            if method == maml_speed.LOOP:
                vs_loop = "1 (the reference)"
            if method in MAML_TARGETS:
                target, met = f">= {MAML_TARGETS[method]}x this (learner)", \
                    _mark(r["speedup_of_learner"] >= MAML_TARGETS[method])
            elif method == maml_speed.COMPILED:
                gain = 1 / r["speedup_of_learner"]
                target, met = f">= {COMPILE_TARGET}x learner (is {gain:.2f}x)", _mark(gain >= COMPILE_TARGET)
            rows.append([method, r["iterations_per_s"]["median"],
                         f"{r['iterations_per_s']['min']:.1f}-{r['iterations_per_s']['max']:.1f}", vs_loop,
                         r["speedup_of_learner"] if method != maml_speed.LEARNER else "", target, met,
                         r["gradient_reference"], _mark(r["meta_gradient_matches"])])
        if maml_speed.HIGHER not in {r["method"] for r in setup["rows"]}:
            target = f">= {MAML_TARGETS[maml_speed.HIGHER]}x this (learner)"
            rows.append([maml_speed.HIGHER, NOT_INSTALLED, "", "", "", target, "", "", ""])
        orders = "; ".join(", ".join(order) for order in setup["orders"])
        markdown += (f"MAML meta-iterations per second, {name} setup ({setup['tasks']} tasks, {setup['shots']} "
                     f"support and {setup['queries']} query points each), 1 thread, float32; speed relative to the "
                     "per-task autograd loop, the plain-PyTorch reference; meta-gradients checked in float64 "
                     "before timing:\n\n" +
                     table(["method", "it/s (median)", "min-max", "speed vs loop", "learner speed-up over it",
                            "target", "met", "meta-gradient checked against", "agrees"], rows) +
                     f"\nAgainst this machine: one of the learner's meta-iterations is "
                     f"{setup['matmul_flops_per_iteration'] / 1e6:.2f} MFLOP of matmuls (torch's FlopCounterMode); "
                     f"at its median it/s that is "
                     f"{setup['learner_flops_per_s'] / 1e9:.2f} GFLOP/s, {setup['fraction_of_peak']:.1%} of the "
                     f"{setup['bmm_peak_flops_per_s'] / 1e9:.1f} GFLOP/s one thread reaches on a bmm of the "
                     f"model's own shapes ({setup['tasks']} x {setup['shots'] + setup['queries']} x 40 @ 40 x 40).\n\n"
                     f"Order of the methods in each repeat (seeded): {orders}. Chart: `maml_speed.png`.\n\n")
    write("maml_speed", {"iterations": iterations, "repeats": repeats,
                         "setups": {n: [s["tasks"], s["shots"], s["queries"]] for n, s in result["setups"].items()}},
          [{"setup": n, **s} for n, s in result["setups"].items()], markdown, quick=quick)
    maml_chart(result["setups"], results_dir(quick))
    return markdown


def maml_chart(setups: dict, directory) -> None:
    """maml_speed.png: each method's meta-iterations per second, median with its [min, max] over repeats, and the
    speed each target asks of the learner (the reference's median times the target)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(setups), 1, figsize=(8, 2.4 * len(setups) + 0.6), squeeze=False)
    for ax, (name, setup) in zip(axes[:, 0], setups.items()):
        rows = setup["rows"]
        speeds = [r["iterations_per_s"] for r in rows]
        ax.errorbar([s["median"] for s in speeds], range(len(rows)),
                    xerr=[[s["median"] - s["min"] for s in speeds], [s["max"] - s["median"] for s in speeds]],
                    fmt="o", capsize=3, label="median [min-max] it/s")
        for r in rows:
            if r["method"] in MAML_TARGETS:  # the learner must run this many times faster than the method
                ax.plot(r["iterations_per_s"]["median"] * MAML_TARGETS[r["method"]],
                        [row["method"] for row in rows].index(maml_speed.LEARNER), "r|", markersize=16)
        ax.plot([], [], "r|", markersize=10, label="learner's target (x the method's median)")
        ax.set_xscale("log")
        ax.set_yticks(range(len(rows)), [r["method"] for r in rows])
        ax.invert_yaxis()
        ax.set_title(f"MAML meta-iterations per second, {name} setup, 1 thread", fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    axes[-1, 0].set_xlabel("meta-iterations per second (log scale)")
    fig.tight_layout()
    fig.savefig(directory / "maml_speed.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def noise_floor(aa_row: dict, ratio: str = "cpu_ratio") -> float:
    """What identical code differs by on this machine: the A/A ratios' largest distance from 1 (`ratio`:
    "cpu_ratio", what the verdicts read, or "ratio", the clock's)."""
    return max(abs(aa_row[ratio]["min"] - 1), abs(aa_row[ratio]["max"] - 1))


def run_parity(quick: bool) -> str:
    cases = [(w, s, "32-true") for w in WORKLOADS for s in ("single", "ddp")]
    cases += [("gan", "fsdp", "32-true"), ("gan", "deepspeed_stage_2", "32-true")]
    if not quick:
        cases += [(w, s, "32-true") for w in ("autoencoder", "metalearn") for s in ("fsdp",)]
        cases += [("autoencoder", "deepspeed_stage_2", "32-true")]
        cases += [(w, "single", "bf16-mixed") for w in WORKLOADS]
    repeats, scale = (2, 1) if quick else (3, 2)
    aa = {}
    for workload in WORKLOADS:  # plain vs plain first: the noise floor each workload's ratios are read against
        print(f"parity: {workload} A/A (plain vs plain)", file=sys.stderr, flush=True)
        aa[workload] = parity.compare(workload, "single", repeats=repeats, scale=scale, against="plain")
    rows = []
    for workload, strategy, precision in cases:
        print(f"parity: {workload} {strategy} {precision}", file=sys.stderr, flush=True)
        rows.append(parity.compare(workload, strategy, precision, repeats=repeats, scale=scale))
    markdown = parity_markdown(aa, rows, results_dir(quick))
    write("parity", {"quick": quick, "cases": cases, "repeats": repeats, "scale": scale},
          [*aa.values(), *rows], markdown, quick=quick)
    return markdown


def parity_markdown(aa: dict, rows: list[dict], directory) -> str:
    """The parity tables: the wrapper against plain doing the same (with the A/A rows), and what a strategy or a
    precision costs where plain PyTorch has no counterpart; their charts into `directory`."""
    wrapper, costs = [], []
    for r in [*aa.values(), *rows]:
        same_work = r["against"] == "plain" or (r["plain"] == r["strategy"] and r["precision"] == "32-true")
        (wrapper if same_work else costs).append(r)

    def line(r):
        weights = "bitwise" if r["weights_bitwise_equal"] else f"max diff {r['weights_max_abs_diff']:.2g}"
        return [r["workload"], "plain (A/A)" if r["against"] == "plain" else r["strategy"], r["precision"],
                r["plain"] if r["against"] != "plain" else "single", r["plain_ms"]["median"],
                r["wrapped_ms"]["median"], _ratio(r["ratio"]), _ratio(r["cpu_ratio"]),
                f"+-{noise_floor(aa[r['workload']]):.3f}", r["plain_memory_mb"], r["wrapped_memory_mb"],
                _mark(r["wrapped_memory_mb"] <= 1.05 * r["plain_memory_mb"]), weights,
                " ".join("".join(v[0] for v in order) for order in r["orders"])]
    columns = ["workload", "strategy", "precision", "plain side", "plain ms", "wrapped ms", "ratio (clock)",
               "CPU ratio", "noise floor", "plain MB", "wrapped MB", "memory <= plain + 5%", "weights", "order"]
    floors = ", ".join(f"{w} {noise_floor(row):.3f} ({noise_floor(row, 'ratio'):.3f} on the clock)"
                       for w, row in aa.items())
    markdown = ("Paired runs of the real scripts, each pair in a random order (seeded, recorded in the last column: "
                "`pw` = plain first). Time per step in ms on the clock, median over logging windows; ratio (clock) "
                "and CPU ratio (rank 0's CPU time per step, user + system): median [min-max] over repeats. `plain "
                "(A/A)` rows run the plain script against itself: their CPU ratios' largest distance from 1 is the "
                f"noise floor of that workload on this machine ({floors}), shown beside every row of the workload. "
                "Time has no verdict here: whole scripts spread by more than the few percent a wrapper may cost (a "
                "ratio inside the floor is indistinguishable from plain at this resolution); the wrapper's cost "
                "resolved to a few percent, with calibrated verdicts, is the [overhead](#overhead) table. Memory: "
                "peak RSS of rank 0 in MB. Weights: `bitwise`, or `max diff`, the largest absolute difference of any "
                "final weight between the two runs.\n\n"
                "**The wrapper's cost**: core against plain PyTorch doing the same work (single: the plain script; "
                "ddp: it under torchrun; fsdp: the workload's plain FSDP2 loop, `benchmarks/plain_fsdp.py`), "
                "32-true: the weights must be bitwise equal.\n\n" + table(columns, [line(r) for r in wrapper]) +
                "\n**What a strategy or a precision costs** (no plain counterpart: not the wrapper's cost): "
                "DeepSpeed, and fsdp for metalearn (which has no plain FSDP2 loop), against plain DDP under torchrun; "
                "bf16-mixed against plain float32. The weights differ by design (DeepSpeed's own optimizer step and "
                "gradient reduction; bfloat16 arithmetic).\n\n" + table(columns, [line(r) for r in costs]) +
                "\nScaling on this 2-core CPU (a cost and correctness figure, not a speed-up: 2 processes of "
                "1 thread each share 2 cores): " + _scaling(rows) + "\n\nCharts: `parity_wrapper.png` (the "
                "wrapper's cost, each ratio with its spread over repeats and the workload's noise band), "
                "`parity_costs.png` (what a strategy or a precision costs).\n")
    directory.mkdir(parents=True, exist_ok=True)
    ratio_chart(directory / "parity_wrapper.png",
                [f"{r['workload']} {'A/A' if r['against'] == 'plain' else r['strategy']}" for r in wrapper],
                [r["cpu_ratio"] for r in wrapper], [noise_floor(aa[r["workload"]]) for r in wrapper],
                "CPU time per step, wrapped / plain (A/A: plain / plain)", "The wrapper's cost (32-true)")
    if costs:
        ratio_chart(directory / "parity_costs.png", [f"{r['workload']} {r['strategy']} {r['precision']}" for r in costs],
                    [r["cpu_ratio"] for r in costs], [None] * len(costs),
                    "CPU time per step, against plain DDP (bf16-mixed: against plain float32)",
                    "What a strategy or a precision costs")
    return markdown


def _ratio(spread: dict) -> str:
    return f"{spread['median']:.3f} [{spread['min']:.3f}-{spread['max']:.3f}]"


def _scaling(rows) -> str:
    parts = []
    for workload in WORKLOADS:
        single = next((r for r in rows if r["workload"] == workload and r["strategy"] == "single"
                       and r["precision"] == "32-true"), None)
        ddp = next((r for r in rows if r["workload"] == workload and r["strategy"] == "ddp"), None)
        if single and ddp:  # DDP steps process twice the examples (one batch per rank)
            speed = 2 * single["wrapped_ms"]["median"] / ddp["wrapped_ms"]["median"]
            parts.append(f"{workload}: 2 processes give {speed:.2f}x the examples/s of one")
    return "; ".join(parts)


def run_checkpoint(quick: bool) -> str:
    """benchmarks/checkpoint.py in its own 2 processes; it prints one RESULT line."""
    params, repeats = (20e6, 1) if quick else (100e6, 3)
    output = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint", "--params", str(params), "--repeats",
                             str(repeats)], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in output.stdout.splitlines() if line.startswith("RESULT ")]
    if output.returncode != 0 or not lines:
        raise RuntimeError(f"benchmarks.checkpoint failed:\n{output.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    bound = 64  # MB: what "a bounded buffer" may add to rank 0 while it saves its shard
    rows = [[kind, r[f"{kind}_save_s"], r[f"{kind}_save_rank0_extra_mb"], r[f"{kind}_load_s"],
             r[f"{kind}_load_rank0_extra_mb"]] for kind in ("sharded", "gathered")]
    markdown = (f"An FSDP model of {r['parameters'] / 1e6:.1f}M parameters with Adam's state on 2 processes (rank 0's "
                f"shard of weights and optimizer state: {r['rank0_shard_mb']:.0f} MB). Sharded: what core writes "
                f"(every rank its own shards, torch.distributed.checkpoint); gathered: the full state dicts on rank "
                f"0's CPU, written by it (a one-file checkpoint, core's fsdp format before). Extra MB: rank 0's peak "
                f"resident memory during the call above what it held before; seconds: the whole call, median of "
                f"{repeats}.\n\n" +
                table(["format", "save s", "save: rank 0 extra MB", "load s", "load: rank 0 extra MB"], rows) +
                f"\nGoal: saving sharded adds at most a bounded buffer ({bound} MB) to rank 0: "
                f"{_mark(r['sharded_save_rank0_extra_mb'] <= bound)}.\n\n"
                f"Checksums (core/checkpoint/integrity.py), inside those figures: the sharded load checks every file "
                f"against its saved hash before using it, the ranks sharing the files out: {r['sharded_verify_s']:.3f} s, "
                f"{r['sharded_verify_s'] / r['sharded_load_s']:.0%} of the load (goal: under 10%: "
                f"{_mark(r['sharded_verify_s'] <= 0.1 * r['sharded_load_s'])}); the save's manifest, written by rank 0 "
                f"over every rank's files: {r['sharded_manifest_s']:.3f} s, "
                f"{r['sharded_manifest_s'] / r['sharded_save_s']:.0%} of the save.\n\n"
                f"In the background (`fabric.save(..., background=True)`, `--save-in-background`): the call returns "
                f"once every rank has copied its state, {r['background_save_s']:.3f} s "
                f"({r['background_save_s'] / r['sharded_save_s']:.0%} of the sharded save; goal: under a fifth of "
                f"the 3.1 s a save took when this was asked: {_mark(r['background_save_s'] < 3.1 / 5)}), for "
                f"{r['background_save_rank0_extra_mb']:.0f} MB of staging copy on rank 0 (its shard: "
                f"{r['rank0_shard_mb']:.0f} MB), held until the write ends; the write then went on for "
                f"{r['background_wait_s']:.3f} s more (measured as a wait with nothing else to do: beside training, "
                f"the two share the cores).\n")
    write("checkpoint", {"params": params, "repeats": repeats}, [r], markdown, quick=quick)
    return markdown


SEEDS = (0, 1, 2)
DEFAULT_THREADS = "each command's default threads (torch's, one per core; metalearn's --threads 1)"  # quality runs'
RENAMED = {"torch's default threads (one per core)": DEFAULT_THREADS}  # the same setting, as older results name it


def _quality_runs() -> list[tuple[str, str, list[str]]]:
    """(workload, setup, extra flags): each workload's default command, and every other command a README quotes a
    quality figure for."""
    runs = [(w.name, "default", []) for w in WORKLOADS.values() if w.quality]
    # the default is the paper's setup with the outer rate on a cosine from 5e-3; beside it, the paper's own rate
    paper = ["--lr", "1e-3", "--lr-schedule", "constant"]
    digits = ["--dataset", "digits", "--inner-lr", "0.4", "--max-steps", "2000"]  # metalearn/README.md's command
    return runs + [("metalearn", "paper's outer rate (1e-3, constant)", paper),
                   ("metalearn", "digits 5-way 1-shot", digits + ["--shots", "1"]),
                   ("metalearn", "digits 5-way 5-shot", digits + ["--shots", "5"]),
                   ("gan", "R1 gamma 1, every 16 steps", ["--r1-gamma", "1"])]  # made the default only if it helps


def run_quality(workloads=None) -> str:
    """Run each workload's quality commands over SEEDS. `workloads`: rerun only these; the other rows stay as
    the last full results have them, each row naming the commit it ran at."""
    previous = {}
    if workloads is not None:
        results = json.loads((RESULTS / "quality.json").read_text())
        for record in results["rows"]:
            record.setdefault("commit", results["environment"]["commit"])
            record["threads"] = RENAMED.get(record.get("threads"), record.get("threads", DEFAULT_THREADS))
            previous[record["workload"], record["setup"]] = record
    commit = environment()["commit"]
    commands, records = [], []
    for name, setup, extra in _quality_runs():
        seed_commands = [["-m", f"{name}.train", *extra, "--seed", str(seed)] for seed in SEEDS]  # what a user runs
        commands += seed_commands
        if workloads is not None and name not in workloads:  # its rows as last run (a setup new since: next time)
            records += [r for key, r in previous.items() if key[0] == name and r not in records]
            continue
        summaries = []
        for seed, command in zip(SEEDS, seed_commands):
            slug = re.sub(r"[^a-z0-9]+", "-", setup.lower()).strip("-")  # e.g. digits-5-way-1-shot
            out = RESULTS / "runs" / f"{name}-{slug}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)  # the benchmark's own scratch run of an earlier invocation
            subprocess.run([sys.executable, *command, "--out", str(out)], cwd=ROOT, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
            summaries.append(json.loads((out / "summary.json").read_text()))
        records.append({"workload": name, "setup": setup, "flags": extra, "summaries": summaries, "commit": commit,
                        "threads": DEFAULT_THREADS})
    markdown = quality_markdown(records)
    threads = "; ".join([DEFAULT_THREADS] + [f"{r['workload']} {r['setup']}: {r['threads']}" for r in records
                                             if r["threads"] != DEFAULT_THREADS])  # rows run otherwise, by hand
    write("quality", {"commands": commands}, records, markdown, threads=threads)
    quality_chart(records, RESULTS)
    return markdown


def quality_chart(records: list[dict], directory) -> None:
    """quality.png: one strip per targeted metric of each workload and setup: every seed's value, their mean, and
    the target (the side that meets it shaded)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strips = []
    for record in records:
        for quality in WORKLOADS[record["workload"]].quality:
            key = quality.metric
            if key not in record["summaries"][0]:
                continue
            values = [s[key]["1"] if key in STEP_METRICS else s[key] for s in record["summaries"]]
            label = f"{STEP_METRICS[key]} after 1 step" if key in STEP_METRICS else key
            strips.append((f"{record['workload']} {record['setup']}\n{label}", values, quality.target))
    fig, axes = plt.subplots(len(strips), 1, figsize=(8, 0.75 * len(strips) + 0.8), squeeze=False)
    for ax, (label, values, target) in zip(axes[:, 0], strips):
        op, bound = target.split()
        bound = float(bound)
        finite = [v for v in values if v is not None]
        low, high = min(finite + [bound]), max(finite + [bound])
        pad = 0.15 * (high - low or abs(bound) or 1)
        ax.set_xlim(low - pad, high + pad)
        ax.axvspan(*((low - pad, bound) if op == "<=" else (bound, high + pad)), color="tab:green", alpha=0.12)
        ax.axvline(bound, color="tab:green", lw=1)
        ax.plot(finite, [0] * len(finite), "o", color="tab:blue", markersize=5, label="each seed")
        if len(finite) == len(values):
            ax.plot(statistics.mean(finite), 0, "D", color="k", markersize=6, label="mean")
        ax.set_yticks([0], [label], fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    axes[0, 0].plot([], [], color="tab:green", lw=6, alpha=0.3, label="meets the target")
    axes[0, 0].legend(loc="lower center", bbox_to_anchor=(0.5, 1.05), ncol=3, frameon=False, fontsize=8)
    fig.suptitle(f"Quality of the default commands, seeds {', '.join(map(str, SEEDS))}", fontsize=10)
    fig.tight_layout()
    fig.savefig(directory / "quality.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _over_seeds(values: list) -> tuple:
    """(mean or None, "min-max (sd)" or which seeds diverged)."""
    if any(v is None for v in values):
        return None, "diverged in " + ", ".join(f"seed {s}" for s, v in zip(SEEDS, values) if v is None)
    return statistics.mean(values), f"{min(values):.4g}-{max(values):.4g} (sd {statistics.stdev(values):.2g})"


# metrics a quality row shows without a target: what each is read against
UNTARGETED = {"raw_fid_classifier": "the same runs' generator without the average",
              "test_accuracy_steps": "guessing: 0.20 (5 ways)"}
STEP_METRICS = {"test_mse_steps": "MSE", "test_accuracy_steps": "accuracy"}  # metalearn: a figure per inner step


def quality_markdown(records: list[dict]) -> str:
    """The quality table of the runs' summaries (one record per workload and setup, one summary per seed)."""
    rows = []
    for record in records:
        name, summaries = record["workload"], record["summaries"]
        metrics = [(q.metric, q) for q in WORKLOADS[name].quality if q.metric in summaries[0]]
        metrics += [(key, None) for key in UNTARGETED if key in summaries[0]]
        for key, quality in metrics:
            mean, spread_text = _over_seeds([s[key]["1"] if key in STEP_METRICS else s[key] for s in summaries])
            ok = ""
            if quality:
                op, bound = quality.target.split()
                ok = _mark(mean is not None and (mean <= float(bound) if op == "<=" else mean >= float(bound)))
            rows.append([name, record["setup"], f"{STEP_METRICS[key]} after 1 step" if key in STEP_METRICS else key,
                         "" if mean is None else f"{mean:.4g}", spread_text, quality.target if quality else "", ok,
                         f"{statistics.mean(s['train_seconds'] for s in summaries):.1f}",
                         quality.reference if quality else UNTARGETED[key]])
    steps = "; ".join(
        f"{r['setup']}: {STEP_METRICS[key]} " + ", ".join("diverged" if m is None else f"{m:.3f}" for m, _ in (
            _over_seeds([s[key][k] for s in r["summaries"]]) for k in r["summaries"][0][key]))
        for r in records for key in STEP_METRICS if key in r["summaries"][0])
    commits = {}
    for r in records:
        commits.setdefault(r.get("commit"), []).append(r["workload"])
    ran_at = "" if len(commits) < 2 else "Rows run at different commits (`--workloads` reran part of them): " + \
        "; ".join(f"{', '.join(dict.fromkeys(names))} at {commit}" for commit, names in commits.items()) + ".\n\n"
    return (ran_at + f"Quality of the default commands on this machine, seeds {', '.join(map(str, SEEDS))} (mean, "
            f"min-max and standard deviation over the seeds; a target is met by the mean; `python -m <workload>.train "
            f"--seed S`, the flags of the setup added):\n\n" +
            table(["workload", "setup", "metric", "mean", "over seeds", "target", "met", "train s (mean)",
                   "reference"], rows) +
            f"\nMAML after 0/1/5/10 inner steps (means over the seeds): {steps}. Chart: `quality.png`.\n\n" +
            QUALITY_NOTES)


QUALITY_NOTES = (
    "GAN: `fid_classifier` is the generator's moving average (`--ema-decay 0.999`, the default), `raw_fid_classifier` "
    "the same runs' raw generator. The default generator ends with `--native-size auto` (8 for digits): its 32 px "
    "output is averaged down to 8x8 and enlarged back bilinearly, as the loader enlarges the 8x8 scans, so it draws "
    "only images the data could hold (`gan/README.md`). With the paper's generator (`--native-size 0`) the same "
    "command scored 1.117 (0.975-1.204, commit 1b8dc7f), short of the 0.9 target. Probes (plain script, seeds 0 / "
    "1, 1 thread, each generator scored on 3 draws of 360 eval images, the EMA's mean; the paper's generator gave "
    "1.02 / 1.12): `--native-size 8` 0.47 / 0.43 (seed 2 0.48); what did not reach the target without it: a "
    "generator learning rate twice the discriminator's 0.94 / 0.94, both at 4e-4 1.28 / 1.27, TTUR the other way "
    "(G 1e-4, D 4e-4) 2.60 / 2.05, Adam betas (0, 0.99) 1.24 / 1.46, batch 32 for 6000 steps 1.11 / 1.07 (25% "
    "longer), `--ndf 16` 1.45 / 1.73, DiffAugment (`--augment translation,cutout`) 1.13 / 1.34, other averages "
    "of the weights (power, uniform, no warm-up) and BatchNorm statistics recomputed for the average: no gain. "
    "The 360-image score is noisy: one generator scored 1.16, 0.77 and 1.12 on three draws. The probes ran at 1 "
    "thread and the table's runs at 2: the thread count changes the order of float sums and, over 3000 GAN steps, "
    "the trajectory (on the default eval draw the probes scored 0.57 / 0.38 / 0.56 for seeds 0-2, the table at "
    "ead227d 0.66 / 0.47 / 0.73). `train s` is the whole run, the final scoring of both generators included.\n\n"
    "MAML: the default is the paper's sinusoid setup (10 query points per task) with the outer learning rate "
    "decaying from 5e-3 to 0 on a cosine; the row beside it holds the paper's constant 1e-3. Measured while "
    "choosing (seed 0, 20k iterations, 1-step MSE): 1e-3 constant 0.423, 2e-3 0.412, 3e-3 cosine 0.390, 5e-3 "
    "cosine with 1000 warm-up steps 0.380 (seeds 0-2: 0.369), without warm-up 0.371 (seeds 0-2: 0.364); 100 "
    "query points at 1e-3 constant (the earlier default) 0.404 over seeds 0-2, its error rising again from 5 to "
    "10 steps (0.166, 0.207). The default runs one thread (`--threads 1`) so that its figures do not depend on "
    "the machine's cores: on two threads (`--threads 0` here) the same command gave 0.397 / 0.367 / 0.384 after 1 "
    "step (mean 0.382, just over the target; 0.133 / 0.126 / 0.162 after 5, 0.108 / 0.104 / 0.115 after 10), "
    "the order of float sums moving the 1-step MSE by up to 0.03; the digits rows were the same on one and two. "
    "Each seed's figures: quality.json.\n")


def update_readme(sections: dict) -> None:
    """Replace the tables between the benchmark markers of benchmarks/README.md, part by part (the root README
    links them and holds no figure of its own)."""
    readme = ROOT / "benchmarks" / "README.md"
    text = readme.read_text()
    start, end = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
    i, j = text.index(start) + len(start), text.index(end)
    blocks = dict(re.findall(r"<!-- (\w+) -->\n(.*?)<!-- /\1 -->\n", text[i:j], re.S))
    for name, markdown in sections.items():
        saved = RESULTS / f"{name}.md"
        header = saved.read_text().split("\n\n", 1)[0] if saved.exists() else ""
        blocks[name] = f"### {name}\n\n{header}\n\n{markdown}\n"
    order = ["overhead", "maml_speed", "parity", "checkpoint", "quality"]
    body = "".join(f"<!-- {name} -->\n{blocks[name]}<!-- /{name} -->\n" for name in sorted(blocks, key=order.index))
    readme.write_text(text[:i] + "\n" + body + text[j:])


PEERS = {"overhead": "lightning", "maml": "higher"}  # a part's peer row, from the bench extra


def missing_peers(parts) -> list[str]:
    """The peer packages that the full results of `parts` hold rows of and this environment lacks."""
    import importlib.util
    return [PEERS[part] for part in parts if part in PEERS and importlib.util.find_spec(PEERS[part]) is None]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats, about 10 minutes on 2 cores; "
                        "writes benchmarks/results/quick/ only, never the full results or the tables")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--no-readme", action="store_true",
                        help="a full run: do not rewrite benchmarks/README.md's tables")
    parser.add_argument("--workloads", help=f"the quality part: rerun only these workloads' rows (comma-separated of "
                        f"{', '.join(WORKLOADS)}), keeping the others from the last full results")
    args = parser.parse_args(argv)
    parts = args.only.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if not args.quick and uncommitted():  # a committed figure must come from code a commit holds
        parser.error("a full run writes the committed results, which must come from a commit: commit (or stash) "
                     "the changes first, or pass --quick (writes results/quick/ only)")
    if not args.quick and missing_peers(parts):  # a full run would replace committed peer rows by "not installed"
        parser.error(f"a full run rewrites the committed results, whose peer rows need "
                     f"{', '.join(missing_peers(parts))}: pip install -e '.[bench]', or pass --quick (writes "
                     f"results/quick/ only)")
    if args.quick and parts == ["quality"]:  # a quick run leaves quality out: it would do nothing
        parser.error("the quality part runs only in a full run (it trains each default command on 3 seeds); "
                     "drop --quick, or choose other parts")
    workloads = None if args.workloads is None else args.workloads.split(",")
    if workloads is not None:
        if set(workloads) - set(WORKLOADS):
            parser.error(f"--workloads: unknown workload(s) {sorted(set(workloads) - set(WORKLOADS))}; choose from "
                         f"{', '.join(WORKLOADS)}")
        if "quality" not in parts or args.quick:
            parser.error("--workloads selects quality rows: pass it with --only quality (a full run, not --quick)")
        if not (RESULTS / "quality.json").exists():
            parser.error(f"--workloads reruns part of the quality rows, but {RESULTS / 'quality.json'} does not "
                         f"exist yet; run the whole quality part first (--only quality without --workloads)")
    runs = {"overhead": run_overhead, "maml": run_maml, "parity": run_parity, "checkpoint": run_checkpoint,
            "machine": machine.run_machine, "cadence": cadence.run_cadence,
            "evaluation": evaluation.run_evaluation, "quality": lambda quick: run_quality(workloads)}
    for part in PARTS:
        if part not in parts or (part == "quality" and args.quick):
            continue
        markdown = runs[part](args.quick)
        print(markdown)
        # part by part, so a later failure loses none; the parts that also run alone have sections of their own
        if not args.quick and not args.no_readme:
            if part in ("machine", "cadence", "evaluation"):
                paste_into_readme(part)
            else:
                update_readme({"maml_speed" if part == "maml" else part: markdown})
    directory = results_dir(args.quick)
    written = sorted(p.name for p in directory.glob("*") if p.suffix in (".md", ".png"))
    print(f"Reports and charts: {directory}/ ({', '.join(written)})" +
          ("; benchmarks/README.md and the full results are unchanged." if args.quick else
           ("" if args.no_readme else "; their tables are in benchmarks/README.md.")))


if __name__ == "__main__":
    main()
