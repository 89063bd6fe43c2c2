"""The benchmark harness on tiny configs: it runs, writes well-formed results, and shows a failing figure
as failing. No timing is asserted here."""
import dataclasses
import io
import json
import os
import random
import re
from pathlib import Path

import pytest
import torch

from benchmarks import calibrate, maml_speed, overhead, paired, parity, record, steps, two_models
from benchmarks import run as bench
from benchmarks.workloads import WORKLOADS
from tests.in_process import run_module


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "uncommitted", lambda: False)  # as from a clean commit, whatever this tree holds
    return tmp_path


def test_a_full_run_from_uncommitted_code_is_refused(results, monkeypatch, capsys):
    monkeypatch.setattr(bench, "uncommitted", lambda: True)
    with pytest.raises(SystemExit) as refused:
        bench.main(["--only", "overhead"])
    assert refused.value.code == 2 and "must come from a commit" in capsys.readouterr().err
    assert not list(results.iterdir())  # nothing written


# one row of each way a row is measured: the MLP on one process and under ddp, a workload's step on one process,
# under ddp and under DeepSpeed. The other rows run the same harness with another precision or workload; each
# workload's two sides are tested by test_a_workload_rows_plain_step_does_the_wrapped_steps_work
MEASURED = ["32-true", "ddp x2", "autoencoder 32-true", "gan ddp x2", "gan deepspeed_stage_2"]


@pytest.mark.slow
@pytest.mark.parametrize("path", MEASURED)
def test_overhead_measures_every_path_in_interleaved_blocks(path):
    """Each row in a process of its own, as a full run takes it."""
    assert path in overhead.ROWS
    row = overhead.run_row(path, rounds=2)  # its own process, as a full run takes it
    assert row["command"].startswith(f"python -m benchmarks.overhead {path}")
    assert list(row["samples"])[:2] == ["plain", "core"] and len(row["orders"]) == 2
    for clock in paired.CLOCKS:
        ratio = row["ratios"]["core"][clock]
        assert ratio["rounds"] == 2 and ratio["interval"][0] <= ratio["ratio"] <= ratio["interval"][1]
    assert ("graph_walk_us" in row) == (path in two_models.SIDES)
    assert set(row["samples"]) <= {"plain", "core", "lightning"}


def test_ddp_rows_keep_results_put_by_ranks_that_ended_between_a_look_and_the_join():
    """The preemption a busy machine gives: both ranks put their results and exit after the parent found the queue
    empty and before its join returned. Their results are in the queue; the row reads them instead of "ended with 0
    result(s) of 2". Ranks that ended with nothing put are still refused."""
    import queue as queues

    class Ranks:  # both ranks have ended by the first join
        def join(self, timeout=None):
            return True

    class LateQueue(queues.SimpleQueue):  # the results land while the parent is between empty() and join()
        looks = 0

        def empty(self):
            self.looks += 1
            return self.looks == 1 or super().empty()

    late = LateQueue()
    late.put({"rank": 1, "result": "b"})
    late.put({"rank": 0, "result": "a"})
    assert [r["result"] for r in overhead.gather(late, Ranks(), 2, "ddp x2")] == ["a", "b"]
    with pytest.raises(RuntimeError, match="ended with 0 result"):
        overhead.gather(queues.SimpleQueue(), Ranks(), 2, "ddp x2")


@pytest.mark.parametrize("workload", list(steps.WORKLOADS))
def test_a_workload_rows_plain_step_does_the_wrapped_steps_work(workload):
    """benchmarks/steps.py: after two steps of each side, every weight and buffer is bitwise the same (32-true, one
    process), so the overhead row compares equal work."""
    assert steps.same_work(workload) == 0.0


@pytest.mark.slow
def test_overhead_times_the_import_and_the_stop_check():
    result = overhead.measure(quick=True, import_repeats=1, paths=())
    assert result["import"]["ratio"] > 0
    assert result["stop_check"]["one_process_us"]["median"] > 0 < result["stop_check"]["two_processes_us"]["median"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["gan deepspeed_stage_2", "gan 16-mixed"])
def test_the_two_model_rows_plain_side_does_the_wrapped_sides_work(path):
    """Bitwise the same weights after 2 steps of each: the ratio is the wrapper's cost, not other arithmetic."""
    import subprocess
    import sys
    code = f"from benchmarks import two_models; print(two_models.same_work({path!r}, steps=2))"
    output = subprocess.run([sys.executable, "-c", code], cwd=record.ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(record.ROOT), "OMP_NUM_THREADS": "1"}, check=True)
    assert float(output.stdout.split()[-1]) == 0.0


@pytest.mark.slow
def test_an_injected_slowdown_turns_the_verdict_to_no():
    """The test-only switch: a busy-wait of 30% of the plain step on the wrapped side, in a quick run. The loop
    alone must cost at least half of what it was sized for (it ran); no upper bound: on a busy machine it runs
    slower than when it was sized (0.68 of the plain step seen in CI), which only makes the verdict surer."""
    row = overhead.run_row("32-true", quick=True, slowdown={"core": 0.3})
    assert "--slowdown=core=0.3" in row["command"] and row["spin_alone"]["core"] > 0.15
    assert paired.verdict(row["ratios"]["core"][row["clock"]]["interval"], overhead.target_of("32-true")) == "no"


def test_scipys_bootstrap_and_trimmed_mean_give_the_stored_runs_their_verdicts():
    """paired.summarize is scipy's trim_mean and bootstrap now; on every row of the stored overhead run (1000
    rounds, 12-200 for ddp and the gan rows) it gives the same estimate, interval ends within a tenth of the
    interval's width of the stored ones (another random stream), and the same verdict."""
    stored = json.loads((Path(bench.ROOT) / "benchmarks" / "results" / "overhead.json").read_text())
    compared = 0
    for row in (row for row in stored["rows"] if "ratios" in row):  # (the import and stop-check rows: no ratios)
        for side, clocks in row["ratios"].items():
            for clock, before in clocks.items():
                now = paired.summarize(row["samples"][side][clock], row["samples"]["plain"][clock], row["seed"])
                assert abs(now["ratio"] / before["ratio"] - 1) < 1e-9, (row["command"], side, clock)
                width = before["interval"][1] - before["interval"][0]
                assert all(abs(a - b) < 0.1 * width for a, b in zip(now["interval"], before["interval"])), \
                    (row["command"], side, clock, now["interval"], before["interval"])
                target = overhead.target_of(row["path"])
                verdicts = [paired.verdict(r["interval"], target).split(" (")[0] for r in (now, before)]
                assert verdicts[0] == verdicts[1], (row["command"], side, clock, verdicts)  # (noise +-X% aside)
                compared += 1
    assert compared >= 18


def test_verdicts_are_taken_on_the_interval():
    assert paired.verdict([0.98, 1.02], 1.03) == "yes"
    assert paired.verdict([1.04, 1.10], 1.03) == "no"
    assert paired.verdict([1.00, 1.06], 1.03) == "no verdict (noise +-3.0%)"
    plain, slower = [1.0, 1.1, 0.9, 1.0, 1.05] * 8, [1.2, 1.32, 1.08, 1.2, 1.26] * 8  # 20% slower, paired by round
    summary = paired.summarize(slower, plain)
    assert summary["ratio"] == pytest.approx(1.2) and summary["interval"] == pytest.approx([1.2, 1.2])
    assert paired.detectable([[0.98, 1.02]] * 10, [1.0] * 10, 1.03) == pytest.approx(0.05)


def test_calibration_counts_verdicts_and_fails_a_row_that_cannot_tell_10_percent():
    def run(aa, slowed):
        return {"spin_alone": {"a/a+3%": 0.03, "a/a+10%": 0.1}, "ratios": {
            "a/a": {"cpu": {"ratio": 1.0, "interval": aa}},
            "a/a+3%": {"cpu": {"ratio": 1.03, "interval": [aa[0] + 0.03, aa[1] + 0.03]}},
            "a/a+10%": {"cpu": {"ratio": 1.1, "interval": slowed}}}}
    sharp = calibrate.summarize_row("32-true", [run([0.99, 1.01], [1.08, 1.12])] * 10)
    assert sharp["passed"] and sharp["sides"]["a/a"]["yes"] == 10 and sharp["sides"]["a/a+10%"]["no"] == 10
    assert sharp["sides"]["a/a+3%"]["no verdict"] == 10 and sharp["detectable"] == pytest.approx(0.05)
    assert sharp["resolves_target"]  # 0% reads yes, 3% never does
    low = calibrate.summarize_row("32-true", [run([0.96, 0.98], [1.08, 1.12])] * 10)  # reads 3% low: 3% passes
    assert low["passed"] and not low["resolves_target"]
    once = calibrate.summarize_row("32-true", [run([0.96, 0.98], [1.08, 1.12])] + [run([0.99, 1.01], [1.08, 1.12])] * 9)
    assert once["sides"]["a/a+3%"]["yes"] == 1 and once["resolves_target"]  # 1 of 10 is allowed
    one_aa_no = calibrate.summarize_row("32-true", [run([1.04, 1.1], [1.08, 1.12])]
                                        + [run([0.99, 1.01], [1.08, 1.12])] * 9)
    assert one_aa_no["sides"]["a/a"]["no"] == 1 and one_aa_no["passed"]  # so is one A/A no in 10
    assert one_aa_no["sides"]["a/a"]["yes"] == 9 and one_aa_no["resolves_target"]  # and 9 A/A yes of 10 is enough
    runs = [run([0.9, 1.1], [1.0, 1.2])] * 9 + [run([1.04, 1.1], [1.1, 1.2])]
    blunt = calibrate.summarize_row("ddp x2", runs, "cpu")
    assert not blunt["passed"] and blunt["sides"]["a/a"]["no"] == 1 and blunt["sides"]["a/a+10%"]["no"] == 1
    assert not blunt["resolves_target"]  # its A/A pair never reads yes
    assert "| ddp x2 |  | cpu | 1.03 | 3%, 10% | 0 / 1 / 9 |" in calibrate.markdown([blunt], ["python -m benchmarks.overhead ddp x2"])


def test_a_workload_row_is_calibrated_at_its_own_target_of_1_percent():
    def run(aa, at_target, larger):
        return {"spin_alone": {"a/a+1%": 0.01, "a/a+3%": 0.03}, "ratios": {
            "a/a": {"cpu": {"ratio": sum(aa) / 2, "interval": aa}},
            "a/a+1%": {"cpu": {"ratio": sum(at_target) / 2, "interval": at_target}},
            "a/a+3%": {"cpu": {"ratio": sum(larger) / 2, "interval": larger}}}}
    sharp = calibrate.summarize_row("metalearn 32-true", [run([0.996, 1.004], [1.006, 1.014], [1.026, 1.034])] * 5)
    assert sharp["target"] == 1.01 and sharp["passed"] and sharp["resolves_target"]
    assert sharp["sides"]["a/a+3%"]["no"] == 5 and sharp["detectable"] == pytest.approx(0.014)
    # noise of +-2%: the 3% slowdown never reads no, so the row cannot be trusted to see a 1% overhead
    wide = calibrate.summarize_row("gan ddp x2", [run([0.98, 1.02], [0.99, 1.03], [1.01, 1.05])] * 5, "cpu")
    assert not wide["passed"] and not wide["resolves_target"]
    assert "| gan ddp x2 |  | cpu | 1.01 | 1%, 3% | 0 / 0 / 5 |" in calibrate.markdown([wide], [])
    # a row stored before the workload rows' own target keeps the calibration it ran: 3% and 10% at 1.03
    old = calibrate.summarize_row("gan 16-mixed", [{"spin_alone": {"a/a+3%": 0.03, "a/a+10%": 0.1}, "ratios": {
        "a/a": {"cpu": {"ratio": 1.0, "interval": [0.99, 1.01]}},
        "a/a+3%": {"cpu": {"ratio": 1.03, "interval": [1.02, 1.04]}},
        "a/a+10%": {"cpu": {"ratio": 1.1, "interval": [1.08, 1.12]}}}}] * 5)
    assert old["target"] == 1.03 and old["passed"]
    assert "| gan 16-mixed |  | cpu | 1.03 | 3%, 10% | 5 / 0 / 0 |" in calibrate.markdown([old, wide], [])


def test_maml_speed_checks_meta_gradients_first_at_both_setups():
    result = maml_speed.measure(iterations=4, repeats=1)
    assert {name: s["queries"] for name, s in result["setups"].items()} == \
        {name: shape[2] for name, shape in maml_speed.setups().items()}  # the default: metalearn/config.py's
    for setup in result["setups"].values():
        rows = {row["method"]: row for row in setup["rows"]}
        assert all(row["meta_gradient_matches"] for row in rows.values())
        assert rows["per-task autograd loop"]["gradient_reference"] == "central finite differences"
        assert rows[maml_speed.LEARNER]["gradient_reference"] == "per-task autograd loop"
        assert {maml_speed.LEARNER, "vmap (torch.func)", maml_speed.COMPILED} <= set(rows)
        assert sorted(setup["orders"][0]) == sorted(rows)
        assert setup["matmul_flops_per_iteration"] > 0 and 0 < setup["fraction_of_peak"] < 10


def test_the_finite_difference_check_catches_a_wrong_meta_gradient(monkeypatch):
    """A first-order loop (inner gradients detached) is not MAML's meta-gradient: the check must say so."""
    import torch.nn.functional as F

    from metalearn.data import Sinusoid
    from metalearn.maml import MetaLearner
    from metalearn.model import MLP
    learner = MetaLearner(MLP(1, 40, 1).double(), F.mse_loss, inner_lr=0.01)
    batch = tuple(t.double() for t in Sinusoid().sample(5, 10, 10, torch.Generator().manual_seed(0)))
    assert maml_speed._finite_difference_check(learner, batch)
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: tuple(g.detach() for g in grad(*a, **k)))
    assert not maml_speed._finite_difference_check(learner, batch)


@pytest.mark.slow
def test_parity_of_a_real_workload_on_one_process(monkeypatch):
    monkeypatch.setitem(WORKLOADS, "metalearn", dataclasses.replace(WORKLOADS["metalearn"], parity_steps=(30, 5)))
    row = parity.compare("metalearn", "single", repeats=1)
    assert row["weights_bitwise_equal"] and row["compared_tensors"] == 6
    assert row["plain_ms"]["n"] == 4 and row["plain_cpu_ms"]["n"] == 4 and row["plain_memory_mb"] > 0
    assert 0 < row["plain_cpu_ms"]["median"] < 2 * row["plain_ms"]["median"]  # one thread: CPU time <= the clock's
    assert row["orders"] in ([["plain", "wrapped"]], [["wrapped", "plain"]])


@pytest.mark.slow
def test_the_a_a_row_runs_the_plain_script_twice_in_a_seeded_order(monkeypatch):
    monkeypatch.setitem(WORKLOADS, "metalearn", dataclasses.replace(WORKLOADS["metalearn"], parity_steps=(30, 5)))
    commands = []
    run = parity._run
    monkeypatch.setattr(parity, "_run", lambda command, out: commands.append(command) or run(command, out))
    row = parity.compare("metalearn", "single", repeats=2, against="plain", seed=3)
    assert all("metalearn.train_torch" in command for command in commands) and len(commands) == 4
    assert row["against"] == "plain" and row["weights_bitwise_equal"]
    draw, again = random.Random("3 metalearn single 32-true plain"), []
    for _ in range(2):
        order = ["plain", "wrapped"]
        draw.shuffle(order)
        again.append(order)
    assert row["orders"] == again  # recorded, and the same seed draws the same order


def test_a_failing_parity_row_is_shown_failing_and_results_are_well_formed(results, monkeypatch):
    fake = {"plain_ms": record.spread([1.0]), "wrapped_ms": record.spread([1.5]), "ratio": record.spread([1.0]),
            "cpu_ratio": record.spread([1.5]),  # the verdict reads CPU time; the clock's ratio is shown beside
            "plain_memory_mb": 100.0, "wrapped_memory_mb": 120.0, "weights_bitwise_equal": False,
            "weights_max_abs_diff": 0.5, "compared_tensors": 3, "steps": 10}
    noise = {"gan": 0.02, "autoencoder": 0.0, "metalearn": 0.0}  # A/A ratios 1 - floor and 1 + floor

    def compare(w, s, p="32-true", against="wrapped", **k):
        if against == "plain":
            aa = {"cpu_ratio": {"median": 1.0, "min": 1 - noise[w], "max": 1 + noise[w], "n": 2},
                  "ratio": record.spread([0.5, 1.5]), "plain_memory_mb": 100.0,
                  "wrapped_memory_mb": 100.0, "weights_bitwise_equal": True}
            return {**fake, **aa, "workload": w, "strategy": s, "precision": p, "against": against,
                    "plain": parity.plain_reference(w, s), "orders": [["wrapped", "plain"], ["plain", "wrapped"]]}
        return {**fake, "workload": w, "strategy": s, "precision": p, "against": against,
                "plain": parity.plain_reference(w, s), "orders": [["wrapped", "plain"]]}

    monkeypatch.setattr(parity, "compare", compare)
    markdown = bench.run_parity(quick=True)
    row = next(line for line in markdown.splitlines() if line.startswith("| gan | single"))
    assert row.count("**no**") == 1 and "max diff 0.5" in row  # memory misses its target; time takes no verdict
    assert "| 1.500 [1.500-1.500] | +-0.020 |" in row and row.endswith("| wp |")  # CPU ratio, floor; wrapped 1st
    assert "| gan | plain (A/A) | 32-true |" in markdown and "gan 0.020 (0.500 on the clock)" in markdown
    deepspeed = next(line for line in markdown.splitlines() if line.startswith("| gan | deepspeed_stage_2"))
    assert "| +-0.020 |" in deepspeed
    saved = json.loads((results / "quick" / "parity.json").read_text())
    assert saved["environment"]["commit"] and saved["environment"]["torch"]
    assert len(saved["rows"]) == 3 + 8 and saved["rows"][0]["against"] == "plain"
    assert (results / "quick" / "parity_wrapper.png").is_file() and (results / "quick" / "parity_costs.png").is_file()
    assert (results / "quick" / "parity.md").read_text().startswith("_commit ")


def test_readme_tables_are_replaced_in_place(results, tmp_path, monkeypatch):
    readme = tmp_path / "benchmarks" / "README.md"  # the tables live beside the benchmarks, not in the root README
    readme.parent.mkdir()
    readme.write_text("intro\nline\n<!-- benchmarks:start -->\n<!-- benchmarks:end -->\noutro\n")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    record.write("overhead", {}, [], "table one\n")
    bench.update_readme({"overhead": "table one\n"})
    bench.update_readme({"overhead": "table two\n"})
    bench.update_readme({"parity": "table three\n"})
    text = readme.read_text()
    assert "table two" in text and "table one" not in text and "table three" in text
    assert text.startswith("intro\nline\n<!-- benchmarks:start -->\n<!-- overhead -->\n### overhead")
    assert text.endswith("<!-- /parity -->\n<!-- benchmarks:end -->\noutro\n")
    assert text.index("table two") < text.index("table three")



def test_the_tables_live_in_the_benchmarks_readme_between_whole_marker_pairs():
    """The generated tables have one home, benchmarks/README.md; the root README only links them."""
    parts = ["overhead", "maml_speed", "parity", "checkpoint", "quality"]
    root = (record.ROOT / "README.md").read_text()
    assert "<!-- benchmarks:" not in root and not any(f"<!-- {name} -->" in root for name in parts)
    text = (record.ROOT / "benchmarks" / "README.md").read_text()
    assert text.count("<!-- benchmarks:start -->") == 1 == text.count("<!-- benchmarks:end -->")
    tables = text[text.index("<!-- benchmarks:start -->"):text.index("<!-- benchmarks:end -->")]
    names = re.findall(r"^<!-- (\w+) -->$", tables, re.M)
    assert names == parts
    for name in names:
        assert text.count(f"<!-- {name} -->") == 1 == text.count(f"<!-- /{name} -->")
        assert tables.index(f"<!-- {name} -->") < tables.index(f"### {name}\n") < tables.index(f"<!-- /{name} -->")


def test_the_hand_pasted_sections_are_the_results_files():
    """machine, cadence and evaluation also run alone and have sections of their own in benchmarks/README.md
    (record.paste_into_readme): as they stand in results/, so a figure there has one source."""
    text = (record.ROOT / "benchmarks" / "README.md").read_text()
    for name in ("machine", "cadence", "evaluation"):
        saved = (record.ROOT / "benchmarks" / "results" / f"{name}.md").read_text().strip()
        assert f"<!-- {name} -->\n{saved}\n" in text, f"paste results/{name}.md after <!-- {name} --> again"

def test_quick_runs_write_beside_the_full_results_and_leave_the_readme(results, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    readme = tmp_path / "benchmarks" / "README.md"
    readme.parent.mkdir()
    readme.write_text("<!-- benchmarks:start -->\n<!-- benchmarks:end -->\n")
    full = {name: results / name for name in ("overhead.md", "overhead.json", "maml_speed.md", "maml_speed.json")}
    for path in full.values():
        path.write_text("full run\n")
    timing = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    slow = {"ratio": 1.09, "interval": [1.06, 1.12], "side_s": 1.09e-4, "plain_s": 1e-4}
    monkeypatch.setattr(overhead, "measure", lambda quick: {  # no Lightning: its row says so; core 6-12% slower
        "rows": [{"path": "32-true", "steps": 20, "rounds": 40, "command": "python -m benchmarks.overhead 32-true",
                  "ratios": {"core": {"cpu": slow, "wall": slow}}}],
        "import": {"core_s": timing, "torch_s": timing, "ratio": 1.0},
        "stop_check": {"one_process_us": timing, "two_processes_us": timing}})
    setup = {"tasks": 25, "shots": 10, "queries": 10, "orders": [[maml_speed.LEARNER, "per-task autograd loop"]],
             "matmul_flops_per_iteration": 1e7, "learner_flops_per_s": 2e9, "bmm_peak_flops_per_s": 5e10,
             "fraction_of_peak": 0.04,
             "rows": [  # no higher; 4.89x misses 5x
                 {"method": "per-task autograd loop", "iterations_per_s": timing, "speed_vs_loop": 1.0,
                  "speedup_of_learner": 4.89, "gradient_reference": "central finite differences",
                  "meta_gradient_matches": True},
                 {"method": maml_speed.LEARNER, "iterations_per_s": timing, "speed_vs_loop": 4.89,
                  "speedup_of_learner": 1.0, "gradient_reference": "per-task autograd loop",
                  "meta_gradient_matches": True},
                 {"method": "vmap (torch.func)", "iterations_per_s": timing, "speed_vs_loop": 2.0,
                  "speedup_of_learner": 2.445, "gradient_reference": "per-task autograd loop",
                  "meta_gradient_matches": True}]}
    monkeypatch.setattr(maml_speed, "measure", lambda iterations, repeats: {"setups": {
        "paper": setup, "default": {**setup, "queries": 100}}})

    bench.main(["--quick", "--only", "overhead,maml"])
    assert readme.read_text() == "<!-- benchmarks:start -->\n<!-- benchmarks:end -->\n"
    assert all(path.read_text() == "full run\n" for path in full.values())
    quick = (results / "quick" / "maml_speed.md").read_text()
    assert ("| per-task autograd loop | 1 | 1.0-1.0 | 1 (the reference) | 4.89 | >= 5x this (learner) | **no** | "
            "central finite differences | yes |") in quick
    assert "| batched (metalearn.maml) | 1 | 1.0-1.0 | 4.89 |  |  |  | per-task autograd loop | yes |" in quick
    assert "| vmap (torch.func) | 1 | 1.0-1.0 | 2 | 2.445 |  |  | per-task autograd loop | yes |" in quick
    assert ("| per-task higher loop | not installed: pip install -e '.[bench]' |  |  |  | >= 20x this (learner) |"
            in quick)
    assert "paper setup (25 tasks, 10 support and 10 query" in quick
    assert "default setup (25 tasks, 10 support and 100 query" in quick
    assert "10.00 MFLOP of matmuls (torch's FlopCounterMode); at its median it/s that is 2.00 GFLOP/s, 4.0% of the " \
        "50.0 GFLOP/s one thread reaches" in quick
    quick_overhead = (results / "quick" / "overhead.md").read_text()
    assert "| lightning | not installed: pip install -e '.[bench]' |" in quick_overhead
    assert "| 32-true | core | 109 | 1.090 [1.060-1.120] | cpu | 1.090 [1.060-1.120] | 9 | <= 1.05: **no** |" \
        in quick_overhead

    with pytest.raises(SystemExit) as refused:  # without the bench extra a full run would drop the peer rows
        monkeypatch.setattr(bench, "missing_peers", lambda parts: ["lightning"])
        bench.main(["--only", "overhead"])
    assert refused.value.code == 2 and full["overhead.md"].read_text() == "full run\n"
    monkeypatch.setattr(bench, "missing_peers", lambda parts: [])  # as with the bench extra installed
    bench.main(["--only", "overhead"])  # a full run of a part: its result files and its README table
    assert "### overhead" in readme.read_text() and "full run" not in full["overhead.md"].read_text()
    assert full["maml_speed.md"].read_text() == "full run\n"

    readme.write_text("<!-- benchmarks:start -->\n<!-- benchmarks:end -->\n")  # a part fails after one that ran:
    monkeypatch.setattr(maml_speed, "measure", lambda iterations, repeats: 1 / 0)  # the table of the first stays
    with pytest.raises(ZeroDivisionError):
        bench.main(["--only", "overhead,maml"])
    assert "### overhead" in readme.read_text()


def test_quality_reruns_only_the_named_workloads_and_says_which_rows_are_older(results, monkeypatch):
    committed = json.loads((record.ROOT / "benchmarks" / "results" / "quality.json").read_text())
    for row in committed["rows"]:  # older rows: one commit, and one setup run otherwise by hand
        row["commit"], row["threads"] = "old5678", "1 thread" if row["setup"] != "default" else bench.DEFAULT_THREADS
    (results / "quality.json").write_text(json.dumps(committed))
    old = {(r["workload"], r["setup"]): r for r in committed["rows"]}
    gan = old["gan", "default"]["summaries"]
    ran, real_run = [], bench.subprocess.run

    def run(command, **kwargs):  # a gan run: the committed summary of that seed with a better score
        if "--seed" not in command:
            return real_run(command, **kwargs)  # git, for the results' header
        seed, out = int(command[command.index("--seed") + 1]), Path(command[command.index("--out") + 1])
        ran.append(command[2])
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({**gan[seed], "fid_classifier": 0.5 + seed / 100}))
    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(bench, "environment", lambda: {"commit": "new1234"})
    bench.main(["--only", "quality", "--workloads", "gan", "--no-readme"])

    gan_setups = {(name, setup) for name, setup, _ in bench._quality_runs() if name == "gan"}
    assert ran == ["gan.train"] * 3 * len(gan_setups)  # the other workloads did not run again
    rows = {(r["workload"], r["setup"]): r for r in json.loads((results / "quality.json").read_text())["rows"]}
    assert rows.keys() == old.keys() | gan_setups
    assert [s["fid_classifier"] for s in rows["gan", "default"]["summaries"]] == [0.5, 0.51, 0.52]
    assert rows["gan", "default"]["commit"] == "new1234"
    for key in old.keys() - gan_setups:
        assert rows[key]["summaries"] == old[key]["summaries"] and rows[key]["commit"] == "old5678"
    markdown = (results / "quality.md").read_text()
    assert "| gan | default | fid_classifier | 0.51 | 0.5-0.52 (sd 0.01) | <= 0.9 | yes |" in markdown
    assert "gan at new1234; autoencoder, metalearn at old5678." in markdown
    by_hand = next(r for r in committed["rows"] if r["setup"] != "default" and r["workload"] != "gan")  # not rerun
    assert f"{bench.DEFAULT_THREADS}; {by_hand['workload']} {by_hand['setup']}: 1 thread" \
        in markdown.splitlines()[0]


def test_quality_rows_read_each_metalearn_setup_by_its_own_metric():
    """A sinusoid setup is scored by its MSE against the target, a digits setup by its accuracy, with no target."""
    def summaries(key, values):
        return [{key: {"0": v / 2, "1": v, "5": v * 2, "10": v * 3}, "train_seconds": 30.0} for v in values]
    markdown = bench.quality_markdown([
        {"workload": "metalearn", "setup": "default", "summaries": summaries("test_mse_steps", [0.36, 0.37, 0.38])},
        {"workload": "metalearn", "setup": "digits 5-way 1-shot",
         "summaries": summaries("test_accuracy_steps", [0.2, 0.3, 0.25])}])
    assert "| metalearn | default | MSE after 1 step | 0.37 | 0.36-0.38 (sd 0.01) | <= 0.38 | yes |" in markdown
    assert "| metalearn | digits 5-way 1-shot | accuracy after 1 step | 0.25 | 0.2-0.3 (sd 0.05) |  |  | 30.0 | " \
           "guessing: 0.20 (5 ways) |" in markdown
    assert "default: MSE 0.185, 0.370, 0.740, 1.110; digits 5-way 1-shot: accuracy 0.125, 0.250, 0.500, 0.750" \
        in markdown


@pytest.mark.parametrize("argv, message", [
    (["--only", "quality", "--workloads", "gans"], "unknown workload(s) ['gans']"),
    (["--only", "parity", "--workloads", "gan"], "pass it with --only quality"),
    (["--only", "quality", "--workloads", "gan"], "run the whole quality part first"),
])
def test_workloads_misuse_is_a_usage_error(argv, message, results, capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_unknown_part_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--only", "speed"])
    assert exit.value.code == 2 and "unknown part" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parity_reads_deepspeed_weights(monkeypatch):
    """A DeepSpeed row compares the weights DeepSpeed saved (a directory) with plain DDP's file."""
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    monkeypatch.setitem(WORKLOADS, "autoencoder", dataclasses.replace(WORKLOADS["autoencoder"], parity_steps=(12, 3)))
    row = parity.compare("autoencoder", "deepspeed_stage_2", repeats=1)
    assert row["compared_tensors"] > 0 and row["weights_max_abs_diff"] < 1e-6


@pytest.mark.slow
@pytest.mark.multiprocess
# gan: G 16 and D 12 float tensors (weights, BatchNorm statistics), the EMA of G 16
@pytest.mark.parametrize("workload, tensors", [("autoencoder", 12), ("gan", 16 + 12 + 16)])
def test_an_fsdp_row_runs_against_the_plain_fsdp2_loop_and_reaches_its_weights(monkeypatch, workload, tensors):
    """The fsdp row's plain side is benchmarks/plain_fsdp.py, whose weights --strategy fsdp must reach bitwise:
    the same shard groups, reduce-scatters and Adam steps on the same data (GAN: the same augmentations and,
    in the checkpoint, the same EMA of G's parameters and buffers)."""
    small = WORKLOADS[workload]
    monkeypatch.setitem(WORKLOADS, workload, dataclasses.replace(
        small, parity={**small.generated_data, **small.small}, parity_steps=(6, 2)))
    commands = []
    run = parity._run
    monkeypatch.setattr(parity, "_run", lambda command, out: commands.append(command) or run(command, out))
    row = parity.compare(workload, "fsdp", repeats=1)
    assert row["plain"] == "fsdp" and sum("benchmarks.plain_fsdp" in command for command in commands) == 1
    assert row["weights_bitwise_equal"] and row["compared_tensors"] == tensors
    assert parity.plain_reference("metalearn", "fsdp") == "ddp"  # no plain FSDP2 loop: against plain DDP


def test_gpu_check_lists_refusals_apart_from_failures(results, monkeypatch, tmp_path):
    """Exit 2 with one line is a refusal by design; any other exit a failure; each in its own table."""
    import subprocess

    from benchmarks import gpu_check
    outcomes = {"refused": (2, "python -m metalearn.train: MAML cannot run under DeepSpeed: ..."),
                "failed": (1, "Traceback (most recent call last):\nRuntimeError: CUDA error: out of memory")}
    statuses = {}
    for kind, (code, stderr) in outcomes.items():
        monkeypatch.setattr(subprocess, "run", lambda *a, code=code, stderr=stderr, **k: subprocess.CompletedProcess(
            a[0], code, "", stderr))
        statuses[kind] = gpu_check.run_case(("metalearn", 1, "deepspeed_stage_2", "32-true"), tmp_path, 10)["status"]
    assert statuses["refused"].startswith("refused: python -m metalearn.train: MAML cannot run")
    assert statuses["failed"] == "failed (exit 1): RuntimeError: CUDA error: out of memory"
    rows = [{"workload": "gan", "devices": 1, "variant": v, "precision": "32-true", "step_ms": 2.0, "ratio": 1.01,
             "peak_cuda_mb": 100.0, "memory_ratio": 1.0, "weights_max_abs_diff": 0.0, "status": status}
            for v, status in (("plain", "ok"), ("single", "ok"), ("deepspeed_stage_2", statuses["refused"]),
                              ("fsdp", statuses["failed"]), ("ddp", "not run: time budget spent"))]
    markdown = gpu_check.report(rows, "a GPU", 1, 12.0, 540)
    assert "**Ran: 2**" in markdown and "**Refused by design (exit 2, one line): 1**" in markdown
    assert "**Failed: 1**" in markdown and "**Not run (time budget): 1**" in markdown
    assert markdown.index("MAML cannot run") < markdown.index("**Failed") < markdown.index("out of memory")
    assert len(json.loads((results / "gpu_check.json").read_text())["rows"]) == 5
    assert len(gpu_check.cases(1)) == 3 * 12 and len(gpu_check.cases(2)) == 3 * 15  # N devices: plain, ddp, fsdp


def test_gpu_check_without_a_gpu_says_so(monkeypatch):
    from benchmarks import gpu_check
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="torch sees no CUDA device; run it on a machine with a GPU"):
        gpu_check.main([])


def test_calibrating_some_rows_keeps_the_others_with_their_commit(results, monkeypatch):
    def run(path, seed=0, quick=False, calibrate=True):
        ratio = {"ratio": 1.0, "interval": [0.99, 1.01]}
        slowed = {"ratio": 1.1, "interval": [1.08, 1.12]}
        return {"path": path, "seed": seed, "samples": {}, "spin_alone": {"a/a+3%": 0.03, "a/a+10%": 0.1},
                "command": f"python -m benchmarks.overhead {path} --seed {seed} --calibrate",
                "ratios": {"a/a": {"cpu": ratio, "thread": ratio}, "a/a+3%": {"cpu": ratio, "thread": ratio},
                           "a/a+10%": {"cpu": slowed, "thread": slowed}}}
    earlier = [calibrate.summarize_row("32-true", [run("32-true")] * 2), run("32-true")]
    (results / "calibration.json").write_text(json.dumps({"environment": {"commit": "old1"}, "rows": earlier}))
    monkeypatch.setattr(overhead, "run_row", run)
    calibrate.run(["ddp x2"], repeats=2)
    markdown = (results / "calibration.md").read_text()
    assert "| 32-true | old1 | cpu | 1.03 | 3%, 10% | 2 / 0 / 0 |" in markdown and "| ddp x2 | " in markdown
    assert "| thread | 1.03 | 3%, 10% | 2 / 0 / 0 | 2 / 0 / 0 | 0 / 2 / 0 |" in markdown
    assert "python -m benchmarks.overhead 32-true --seed S --calibrate" in markdown
    rows = json.loads((results / "calibration.json").read_text())["rows"]
    assert [r["path"] for r in rows if "passed" in r] == ["32-true", "ddp x2"] and len(rows) == 2 + 1 + 2


def test_the_machine_part_records_each_counted_call_and_replays_it_on_its_own_shapes():
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks import machine
    a, b = torch.randn(64, 128), torch.randn(256, 128).t()  # b not contiguous: its strides must come back
    images, weight = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    counter, recorder = FlopCounterMode(display=False), machine.Recorder()
    with counter, recorder:
        for _ in range(3):
            torch.mm(a, b)
        torch.nn.functional.conv2d(images, weight, padding=1)
        torch.relu(images)  # no FLOPs counted: not recorded
    assert sorted(recorder.calls.values()) == [1, 3]
    mm = next(key for key in recorder.calls if recorder.calls[key] == 3)
    assert recorder.flops[mm] == 2 * 64 * 128 * 256
    assert sum(recorder.calls[k] * recorder.flops[k] for k in recorder.calls) == counter.get_total_flops()
    rebuilt = machine._build(mm[1])
    assert [(t.shape, t.stride()) for t in rebuilt] == [(a.shape, a.stride()), (b.shape, b.stride())]
    assert set(machine.replayed_seconds(recorder)) == {"mm", "convolution"}


def test_the_machine_part_counts_one_step_of_the_default_command():
    """The autoencoder's default command stopped after its windows: the counted step's FLOPs are those of one
    default step counted apart (the model's forward and backward on a batch of 64 digits)."""
    from torch.utils.flop_counter import FlopCounterMode

    from autoencoder.config import Config
    from autoencoder.model import AutoEncoder
    from benchmarks import machine
    config = Config()
    model = AutoEncoder(1, config.latent, config.image_size, config.width)
    images = torch.randn(config.batch_size, 1, config.image_size, config.image_size)
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.mse_loss(model(images), images).backward()
    row = machine.measure_workload("autoencoder", warmup=1, timed=3, profiled=1)
    assert row["flops_per_step"] == counter.get_total_flops()
    assert row["timed_steps"] == 3 and row["step_min_s"] <= row["step_s"] <= row["step_max_s"]
    assert 0 < row["fraction"] and len(row["profile"]) == machine.TOP_OPS
    assert sum(p["share"] for p in row["profile"]) <= 1


HELP_MODULES = ["cadence", "calibrate", "compare", "evaluation", "gpu_check", "machine", "overhead", "run",
                "checkpoint", "plain_fsdp"]


def test_every_benchmark_command_answers_help(tmp_path, monkeypatch):
    """`python -m benchmarks.<module> --help` prints its usage and exits 0 (a % in a help text broke it once).
    Each runs in this process as `python -m` runs it (tests/in_process.py), so the ten pay no interpreter start."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # else benchmarks.checkpoint re-executes itself to set it
    wrong = {}
    for module in HELP_MODULES:
        stdout = io.StringIO()
        status, stderr = run_module(f"benchmarks.{module}", ["--help"], tmp_path, stdout=stdout)
        if status != 0 or not stdout.getvalue().strip() or "Traceback" in stderr:
            wrong[module] = (status, stderr[-500:])
    assert not wrong, wrong


def test_a_part_that_runs_alone_pastes_its_results_into_its_readme_section(results, tmp_path, monkeypatch):
    """`python -m benchmarks.machine` (and cadence, evaluation, or run.py's full run of them) puts its results file
    between its markers in benchmarks/README.md, leaving the rest of the page as it was."""
    monkeypatch.setattr(record, "ROOT", tmp_path)
    (tmp_path / "benchmarks").mkdir()
    readme = tmp_path / "benchmarks" / "README.md"
    readme.write_text("intro\n<!-- machine -->\nold table\n<!-- /machine -->\nafter\n")
    (results / "machine.md").write_text("_commit abc_\n\nnew table\n")
    record.paste_into_readme("machine")
    assert readme.read_text() == "intro\n<!-- machine -->\n_commit abc_\n\nnew table\n<!-- /machine -->\nafter\n"
