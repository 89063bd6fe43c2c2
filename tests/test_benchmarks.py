"""The benchmark harness on tiny configs: it runs, writes well-formed results, and shows a failing figure
as failing. No timing is asserted here."""
import dataclasses
import json

import pytest

from benchmarks import maml_speed, overhead, parity, record
from benchmarks import run as bench
from benchmarks.workloads import WORKLOADS


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    return tmp_path


def test_overhead_measures_every_variant(results):
    result = overhead.measure(blocks=2, steps=5)
    names = [row["variant"] for row in result["rows"]]
    assert names[:2] == ["plain", "core"]
    for row in result["rows"]:
        assert row["us_per_step"]["median"] > 0 and row["ratio"]["n"] == 2
    assert result["import"]["ratio"] > 0
    assert result["stop_check"]["one_process_us"]["median"] > 0 < result["stop_check"]["two_processes_us"]["median"]


def test_maml_speed_checks_meta_gradients_first():
    result = maml_speed.measure(iterations=4, repeats=1)
    assert all(row["meta_gradient_matches"] for row in result["rows"])
    assert {"vmap (torch.func)", "per-task autograd loop"} <= {row["method"] for row in result["rows"]}


def test_parity_of_a_real_workload_on_one_process(monkeypatch):
    monkeypatch.setitem(WORKLOADS, "metalearn", dataclasses.replace(WORKLOADS["metalearn"], parity_steps=(30, 5)))
    row = parity.compare("metalearn", "single", repeats=1)
    assert row["weights_bitwise_equal"] and row["compared_tensors"] == 6
    assert row["plain_ms"]["n"] == 4 and row["plain_memory_mb"] > 0


def test_a_failing_parity_row_is_shown_failing_and_results_are_well_formed(results, monkeypatch):
    fake = {"plain_ms": record.spread([1.0]), "wrapped_ms": record.spread([1.5]), "ratio": record.spread([1.5]),
            "plain_memory_mb": 100.0, "wrapped_memory_mb": 120.0, "weights_bitwise_equal": False,
            "weights_max_abs_diff": 0.5, "compared_tensors": 3, "steps": 10}
    monkeypatch.setattr(parity, "compare", lambda w, s, p="32-true", **k: {**fake, "workload": w, "strategy": s,
                                                                           "precision": p})
    markdown = bench.run_parity(quick=True)
    row = next(line for line in markdown.splitlines() if line.startswith("| gan | single"))
    assert row.count("**no**") == 2 and "max diff 0.5" in row  # time and memory both miss their targets
    saved = json.loads((results / "quick" / "parity.json").read_text())
    assert saved["environment"]["commit"] and saved["environment"]["torch"]
    assert len(saved["rows"]) == 8 and (results / "quick" / "parity.png").is_file()
    assert (results / "quick" / "parity.md").read_text().startswith("_commit ")


def test_readme_tables_are_replaced_in_place(results, tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
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


def test_quick_runs_write_beside_the_full_results_and_leave_the_readme(results, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- benchmarks:start -->\n<!-- benchmarks:end -->\n")
    full = {name: results / name for name in ("overhead.md", "overhead.json", "maml_speed.md", "maml_speed.json")}
    for path in full.values():
        path.write_text("full run\n")
    timing = {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    monkeypatch.setattr(overhead, "measure", lambda blocks: {  # no Lightning: its row says so
        "rows": [{"variant": v, "us_per_step": timing, "ratio": timing, "overhead_us": 0.0} for v in ("plain", "core")],
        "import": {"core_s": timing, "torch_s": timing, "ratio": 1.0},
        "stop_check": {"one_process_us": timing, "two_processes_us": timing}})
    monkeypatch.setattr(maml_speed, "measure", lambda iterations, repeats: {"rows": [  # no higher; 4.89x misses 5x
        {"method": "vmap (torch.func)", "iterations_per_s": timing, "speedup_of_vmap": 1.0,
         "meta_gradient_matches": True},
        {"method": "per-task autograd loop", "iterations_per_s": timing, "speedup_of_vmap": 4.89,
         "meta_gradient_matches": True}]})

    bench.main(["--quick", "--only", "overhead,maml"])
    assert readme.read_text() == "<!-- benchmarks:start -->\n<!-- benchmarks:end -->\n"
    assert all(path.read_text() == "full run\n" for path in full.values())
    quick = (results / "quick" / "maml_speed.md").read_text()
    assert "| per-task autograd loop | 1 | 1.0-1.0 | 4.89 | >= 5 | **no** | yes |" in quick
    assert "| per-task higher loop | not installed: pip install -e '.[bench]' |" in quick
    assert "| lightning | not installed: pip install -e '.[bench]' |" in (results / "quick" / "overhead.md").read_text()

    bench.main(["--only", "overhead"])  # a full run of a part: its result files and its README table
    assert "### overhead" in readme.read_text() and "full run" not in full["overhead.md"].read_text()
    assert full["maml_speed.md"].read_text() == "full run\n"


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
