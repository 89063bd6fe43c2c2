"""Several machines, simulated on this one: two torchrun "nodes" of one process each on 127.0.0.1, and the
environment SLURM's srun gives each task, end as one node with the same number of processes does."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from benchmarks.overhead import free_port
from tests.conftest import ROOT, TORCHRUN, run

SMALL = {"gan": ["--batch-size", "8", "--ngf", "8", "--ndf", "8", "--nz", "16", "--eval-samples", "8"],
         "autoencoder": ["--batch-size", "8", "--width", "4"],
         "metalearn": ["--hidden", "16", "--eval-tasks", "10"]}
WRAPPED = ["--accelerator", "cpu", "--strategy", "ddp"]


def weights(out) -> dict:
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    saved = saved.get("state", saved)
    return {f"{key}.{name}": value for key, entry in saved.items() if isinstance(entry, dict)
            for name, value in entry.items() if isinstance(value, torch.Tensor) and value.is_floating_point()}


def assert_close_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def start_all(commands: list[list[str]], envs: list[dict], cwd=ROOT) -> list[str]:
    """Start every command at once (the nodes wait for each other); their outputs, once all exited 0."""
    processes = [subprocess.Popen([sys.executable, *command], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT),
                                  "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for command, env in zip(commands, envs)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), "\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.mark.slow
@pytest.mark.multiprocess
# core's launcher and torchrun's rendezvous, which the workloads do not branch on: one wrapped and one plain
# script (the autoencoder runs on two nodes in the srun tests below)
@pytest.mark.parametrize("script", ["gan.train", "gan.train_torch"])
def test_two_torchrun_nodes_end_as_one_node_of_two_processes(tmp_path, script):
    workload = script.split(".")[0]
    wrapped = [*WRAPPED, "--devices", "1", "--num-nodes", "2"] if script.endswith(".train") else []
    args = ["-m", script, *SMALL[workload], *wrapped, "--max-steps", "4", "--log-every", "2"]
    port = free_port()
    nodes = [["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
              "--master-addr", "127.0.0.1", "--master-port", str(port), *args, "--out", str(tmp_path / "nodes")]
             for rank in (0, 1)]
    start_all(nodes, [{}, {}])
    assert "steps" in json.loads((tmp_path / "nodes" / "summary.json").read_text())
    if script.endswith(".train"):
        run(["-m", script, *SMALL[workload], *WRAPPED, "--devices", "2", "--max-steps", "4", "--log-every", "2",
             "--out", str(tmp_path / "one")], timeout=300)
    else:
        run([*TORCHRUN, "-m", script, *SMALL[workload], "--max-steps", "4", "--log-every", "2", "--out",
             str(tmp_path / "one")], timeout=300)
    assert_close_weights(weights(tmp_path / "nodes"), weights(tmp_path / "one"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_environment_srun_gives_two_tasks_on_two_nodes(tmp_path):
    """What `srun --nodes 2 --ntasks-per-node 1 python -m autoencoder.train --num-nodes 2 ...` runs on each node."""
    args = ["-m", "autoencoder.train", *SMALL["autoencoder"], *WRAPPED, "--devices", "1", "--num-nodes", "2",
            "--max-steps", "4", "--log-every", "2"]
    job = {"SLURM_JOB_ID": str(free_port()), "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "127.0.0.1"}
    tasks = [{**job, "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank)} for rank in (0, 1)]
    start_all([[*args, "--out", str(tmp_path / "slurm")]] * 2, tasks)
    run(["-m", "autoencoder.train", *SMALL["autoencoder"], *WRAPPED, "--devices", "2", "--max-steps", "4",
         "--log-every", "2", "--out", str(tmp_path / "one")], timeout=300)
    assert_close_weights(weights(tmp_path / "slurm"), weights(tmp_path / "one"))


def readme_srun_line() -> tuple[int, list[str]]:
    """The number of nodes and the command of the srun line of the sbatch script in docs/runs.md."""
    text = (ROOT / "docs" / "runs.md").read_text()
    script = next(block for block in re.findall(r"```sh\n(.*?)```", text, re.S) if "#SBATCH" in block)
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", script).group(1))
    line = next(line for line in script.splitlines() if line.startswith("srun "))
    return nodes, shlex.split(line)[1:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_readmes_sbatch_script_runs_under_the_environment_srun_gives(tmp_path):
    nodes, command = readme_srun_line()
    assert command[:3] == ["python", "-m", "gan.train"] and nodes == 2
    job_id = str(free_port())
    words = [word.replace("$SLURM_JOB_ID", job_id) for word in command[1:]]
    job = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "gan", "SLURM_NTASKS": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_JOB_NODELIST": "127.0.0.1"}
    tasks = [{**job, "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank)}
             for rank in range(nodes)]
    out = tmp_path / f"runs/gan-{job_id}"
    args = [*words, "--accelerator", "cpu", "--max-steps", "4", "--log-every", "2", "--ngf", "8", "--ndf", "8",
            "--eval-samples", "8"]
    outputs = start_all([args] * nodes, tasks, cwd=tmp_path)
    assert "--resume auto: no checkpoint in" in outputs[0]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    requeued = start_all([[*args[:args.index("--max-steps") + 1], "6", *args[args.index("--max-steps") + 2:]]] * nodes,
                         tasks, cwd=tmp_path)  # the job again, as --requeue starts it, with more steps
    assert "Resumed from" in requeued[0] and json.loads((out / "summary.json").read_text())["steps"] == 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_directory_that_another_node_does_not_see_stops_the_run_at_start(tmp_path):
    """Node-local disks, simulated: each "node" runs in its own folder with the same relative --out, so rank 1's
    runs/job is another directory than rank 0's. fsdp would write a checkpoint lacking rank 1's shard; the run
    stops before its first step instead, with one line on the rank that does not see rank 0's directory."""
    port = free_port()
    processes = []
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
             str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "gan.train",
             *SMALL["gan"], "--accelerator", "cpu", "--strategy", "fsdp", "--devices", "1", "--num-nodes", "2",
             "--max-steps", "20", "--checkpoint-every", "5", "--out", "runs/job"],
            cwd=tmp_path / f"node{rank}", env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert all(process.returncode != 0 for process in processes)
    errors = [line for line in outputs[1].splitlines() if line.startswith("python -m gan.train: error:")]
    assert len(errors) == 1 and "does not see the run directory" in errors[0] and "every node sees" in errors[0]
    assert not list(tmp_path.rglob("*.distcp")) and not list(tmp_path.rglob("last.ckpt"))


def test_a_sharded_save_that_a_rank_cannot_see_stops_before_writing(tmp_path):
    """Core's own guard for Fabric users: a rank that does not see the folder rank 0 made for a sharded
    checkpoint raises before any shard is written (rank 0's folder is elsewhere: another node's disk)."""
    from core.checkpoint import files

    files.clear_directory(tmp_path / "node0" / ".last.ckpt.tmp", 0, barrier=lambda: None)
    with pytest.raises(files.CheckpointError, match="rank 1 does not see the folder .* every node sees"):
        files.clear_directory(tmp_path / "node1" / ".last.ckpt.tmp", 1, barrier=lambda: None)


@pytest.mark.multiprocess
def test_a_rank_that_waits_past_the_collective_timeout_stops_with_one_line(tmp_path):
    """Rank 0's first evaluation trains the score's classifier (an empty cache) while rank 1 waits for the
    score; with --collective-timeout 5 rank 1 stops, naming the flag, and the run ends."""
    result = run(["-m", "gan.train", *SMALL["gan"], *WRAPPED, "--devices", "2", "--max-steps", "4", "--eval-every",
                  "2", "--collective-timeout", "5", "--out", str(tmp_path / "run")], check=False, timeout=300,
                 env={"SUITE_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 1, result.stderr[-3000:]
    stopped = re.findall(r"python -m gan.train: stopped: [^\r\n]*", result.stderr)  # (after a progress bar's \r)
    assert len(stopped) == 1 and "rank 1 waited more than 5 s" in stopped[0] and "--collective-timeout" in stopped[0]
    assert "Traceback" not in result.stderr
