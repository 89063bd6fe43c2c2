"""What a new user meets first: threads per process, one-line errors, --help, and what a failed start
leaves behind."""
import os
import subprocess
import sys
import textwrap

import pytest

from core import launcher
from tests.conftest import ROOT

THREADS_PROBE = textwrap.dedent("""
    import torch
    from core import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    print(f"rank {fabric.global_rank} threads {torch.get_num_threads()}", flush=True)
""")


def test_threads_per_process_share_the_cores_unless_omp_num_threads_says(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "_usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launcher.threads_per_process(2) == 4 and launcher.threads_per_process(16) == 1
    assert capsys.readouterr().err.count("Set OMP_NUM_THREADS") == 2
    assert launcher.threads_per_process(2, announce=False) == 4 and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice (or torchrun's) wins, silently
    assert launcher.threads_per_process(2) == 3 and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many' is not a whole number"):
        launcher.threads_per_process(2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("chosen", [None, "2"])
def test_every_rank_of_a_rerun_uses_the_same_threads(tmp_path, chosen):
    script = tmp_path / "probe.py"
    script.write_text(THREADS_PROBE)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    if chosen:
        env["OMP_NUM_THREADS"] = chosen
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    expected = int(chosen) if chosen else max(1, len(os.sched_getaffinity(0)) // 2)
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank 0 threads {expected}", f"rank 1 threads {expected}"]
    assert result.stderr.count("Set OMP_NUM_THREADS") == (0 if chosen else 1)  # said once, by rank 0
