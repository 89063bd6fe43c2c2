"""Checkpoints across strategies and numbers of processes: one logical checkpoint (names, not positions),
fsdp saved sharded through torch.distributed.checkpoint, DeepSpeed converted from its partitions, the
plain file `python -m core.convert` writes, and the safety of every format."""
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from core import CheckpointError, Fabric, checkpoint
from core.checkpoint import sharded
from tests.conftest import built_once, run

ONE, TWO = ["single", "fsdp", "deepspeed_stage_2"], ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
        return True
    except ImportError:
        return False


def _strategies(names):
    return ",".join(name for name in names if _has_deepspeed() or not name.startswith("deepspeed"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of each source: 3 steps of two models (Adam, SGD with momentum) under single (and as the
    plain scripts save), ddp, fsdp and DeepSpeed ZeRO-2 and -3 on 2 processes."""
    def build(root):
        run(["tests/checkpoint_matrix.py", "--strategy", "single", "--plain", "--save", str(root)], timeout=300)
        run(["tests/checkpoint_matrix.py", "--strategy", _strategies(TWO), "--devices", "2", "--save", str(root)],
            timeout=400)
    return built_once(tmp_path_factory, "checkpoint-matrix", build)  # once for the session's workers


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [1, 2])
def test_every_checkpoint_resumes_under_every_strategy_and_process_count(saved, tmp_path, devices):
    """Under each strategy on 1 and on 2 processes, every source's checkpoint loads with weights equal to the
    saved ones bit for bit, and 3 more steps match 6 uninterrupted steps on the new shape (a lost or misplaced
    optimizer state, or a wrong step count, moves them by 1e-3 and more)."""
    sources = sorted(p.name for p in saved.iterdir())
    out = tmp_path / "result.json"
    targets = _strategies(ONE if devices == 1 else TWO)
    run(["tests/checkpoint_matrix.py", "--strategy", targets, "--devices", str(devices),
         "--load", ",".join(str(saved / name) for name in sources), "--out", str(out)], timeout=600)
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(f"{target}x{devices}" for target in targets.split(","))
    assert len(sources) == 2 + len(_strategies(TWO).split(","))
    for target, loaded in results.items():
        assert sorted(loaded) == sources, target
        for source, result in loaded.items():
            assert result["step"] == 3, (target, source)
            assert result["loaded_max_diff"] == 0.0, (target, source, result)
            assert result["continued_max_diff"] < 1e-5, (target, source, result)
            assert "hidden.weight" in result["other_shape"] and "16" in result["other_shape"], (target, source, result)


def test_optimizer_state_follows_parameter_names_not_positions(tmp_path):
    """A checkpoint loads into an optimizer that lists the same parameters in another order."""
    fabric = Fabric(accelerator="cpu")
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(5, 3)).square().sum())
    optimizer.step()
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": optimizer})
    saved = checkpoint.load_checkpoint(tmp_path / "a.ckpt")["optimizer"]["optimizer"]
    assert saved["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]

    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    reversed_order = list(other.parameters())[::-1]
    other, other_optimizer = fabric.setup(other, torch.optim.Adam(reversed_order, lr=0.1))
    fabric.load(tmp_path / "a.ckpt", {"model": other, "optimizer": other_optimizer})
    for name, p in other.named_parameters():
        expected = optimizer.state[dict(model.named_parameters())[name]]["exp_avg"]
        assert torch.equal(other_optimizer.state[p]["exp_avg"], expected), name


def test_an_optimizer_of_other_groups_is_refused_by_name(tmp_path):
    fabric = Fabric(accelerator="cpu")
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.save(tmp_path / "a.ckpt", {"optimizer": optimizer, "model": model})
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    groups = [{"params": other[0].parameters()}, {"params": other[1].parameters()}]
    other, other_optimizer = fabric.setup(other, torch.optim.SGD(groups, lr=0.1))
    with pytest.raises(CheckpointError, match="has 1 parameter groups, this one 2"):
        fabric.load(tmp_path / "a.ckpt", {"model": other, "optimizer": other_optimizer})


def test_a_sharded_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "last.ckpt"
    sharded.save(path, {"model": {"w": torch.ones(3)}, "step": 1}, 0, lambda: None)
    real_save = dcp.save

    def killed(state, **kwargs):
        real_save(state, **kwargs)  # the shards are written, state.pt and the rename are not
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(dcp, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        sharded.save(path, {"model": {"w": torch.zeros(3)}, "step": 2}, 0, lambda: None)
    state = checkpoint.read(path)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))
    monkeypatch.setattr(dcp, "save", real_save)
    sharded.save(path, {"model": {"w": torch.zeros(3)}, "step": 2}, 0, lambda: None)  # the next save cleans up
    assert checkpoint.read(path)["step"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_what_a_killed_replacement_left_is_mended_by_load_and_by_the_next_save(tmp_path):
    """The two states a kill inside replace_directory leaves (tests/test_save_kills.py kills real runs there)."""
    path, old = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.old"
    sharded.save(path, {"model": {"w": torch.ones(3)}, "step": 1}, 0, lambda: None)
    path.rename(old)  # killed between moving the checkpoint aside and moving the new one in
    assert Fabric(accelerator="cpu").load(path)["step"] == 1 and not old.exists()
    shutil.copytree(path, old)
    (old / "state.pt").unlink()  # killed while removing the replaced checkpoint
    sharded.save(path, {"model": {"w": torch.zeros(3)}, "step": 2}, 0, lambda: None)
    assert checkpoint.read(path)["step"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_sharded_metadata_that_would_run_code_is_refused_unrun(tmp_path):
    path, marker = tmp_path / "last.ckpt", tmp_path / "pwned"
    sharded.save(path, {"model": {"w": torch.ones(3)}, "step": 1}, 0, lambda: None)
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    for reader in (checkpoint.read, sharded.SafeReader(str(path)).read_metadata):
        with pytest.raises(CheckpointError, match=r"asks for (posix|os)\.system.*refused without running any of it"):
            reader(path) if reader is checkpoint.read else reader()
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_with_pickled_entries_is_refused(tmp_path):
    """DCP writes non-tensor values as pickles and would load them with weights_only=False; core never
    writes them, and refuses a checkpoint that has them before reading any."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "foreign"
    dcp.save({"w": torch.ones(2), "extra": {"lr": 0.1}}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    checkpoint.save_checkpoint({}, path / "state.pt")
    with pytest.raises(CheckpointError, match=r"holds pickled objects \(\['extra.lr'\]\)"):
        checkpoint.read(path)


def test_a_deepspeed_file_that_would_run_code_is_refused_unrun(tmp_path):
    pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    path, marker = tmp_path / "last.ckpt", tmp_path / "pwned"
    checkpoint.save_checkpoint({"model": {"deepspeed_tag": "model", "world_size": 2, "stage": 2}}, path / "state.pt")
    (path / "model").mkdir()
    torch.save({"module": _Exploit(marker)}, path / "model" / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, path / "model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="refused unread"):
        checkpoint.read(path)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_convert_makes_one_plain_file_that_the_plain_script_resumes(tmp_path):
    """gan under fsdp x2 (a sharded directory) -> python -m core.convert -> torch.load(weights_only) and the
    plain script's --resume, on the default data; the plain script's own --resume of the directory says how."""
    run(["-m", "gan.train", "--accelerator", "cpu", "--strategy", "fsdp", "--devices", "2", "--max-steps", "3",
         "--out", str(tmp_path / "fsdp")])
    refused = run(["-m", "gan.train_torch", "--resume", str(tmp_path / "fsdp"), "--max-steps", "5"], check=False)
    assert refused.returncode == 2 and "python -m core.convert" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    run(["-m", "core.convert", str(tmp_path / "fsdp"), str(tmp_path / "plain.ckpt")])
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    sharded_state = checkpoint.read(tmp_path / "fsdp" / "checkpoints" / "last.ckpt")
    assert plain["step"] == 3
    for key in ("generator", "discriminator"):
        assert all(torch.equal(plain[key][name], value) for name, value in sharded_state[key].items())
    assert sorted(plain["optimizer_g"]["state"]) == list(range(len(plain["optimizer_g"]["state"])))  # by position
    result = run(["-m", "gan.train_torch", "--resume", str(tmp_path / "plain.ckpt"), "--max-steps", "5",
                  "--out", str(tmp_path / "plain")])
    assert f"Resumed from {tmp_path / 'plain.ckpt'} at step 3, writing to {tmp_path / 'plain'}" in result.stdout
    assert torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)["step"] == 5


def test_convert_misuse_exits_2_with_one_line(tmp_path):
    result = run(["-m", "core.convert", str(tmp_path / "missing"), str(tmp_path / "out.ckpt")], check=False)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"python -m core.convert: error: no checkpoint at {tmp_path / 'missing'}"]


@pytest.mark.slow
def test_the_plain_script_resumes_a_wrapped_run_exactly(tmp_path):
    """autoencoder through core, 4 steps -> plain script --resume to 8 == 8 plain steps, bit for bit (on the CPU)."""
    common, cpu = ["-m", "autoencoder.train_torch", "--max-steps", "8"], {"CUDA_VISIBLE_DEVICES": ""}
    run(["-m", "autoencoder.train", "--accelerator", "cpu", "--max-steps", "4", "--out", str(tmp_path / "wrapped")])
    run([*common, "--resume", str(tmp_path / "wrapped"), "--out", str(tmp_path / "resumed")], env=cpu)
    run([*common, "--out", str(tmp_path / "plain")], env=cpu)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
    plain = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["step"] == plain["step"] == 8
    assert all(torch.equal(resumed["model"][k], plain["model"][k]) for k in plain["model"])


@pytest.mark.parametrize("failure", [torch.OutOfMemoryError("CPU out of memory"),
                                     RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
                                     ValueError("Size mismatch between saved torch.Size([3]) and current: [4] for w"),
                                     OSError("unexpected end of file")])
def test_a_failed_sharded_load_keeps_a_resource_or_peer_failure_as_itself(tmp_path, monkeypatch, failure):
    """Only keys or shapes that do not fit say "does not match", and only file problems say "could not be read":
    running out of memory or losing a peer mid-load is not bad input (exit 2) but a failure with its own message."""
    import traceback

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    sharded.save(tmp_path / "c", {"model": {"w": torch.ones(3)}}, 0, lambda: None)

    def failing(*args, **kwargs):
        raise CheckpointException("load", {0: (failure, traceback.StackSummary())})

    monkeypatch.setattr(dcp, "load", failing)
    with pytest.raises(BaseException) as raised:
        sharded.load_into(tmp_path / "c", {"model": {"w": torch.zeros(3)}})
    if isinstance(failure, (ValueError, OSError)):
        assert isinstance(raised.value, CheckpointError)
        assert ("does not match" if isinstance(failure, ValueError) else "could not be read") in str(raised.value)
    else:
        assert raised.value is failure


def _damage(checkpoint_path, how: str) -> str:
    """Damage a checkpoint as storage does; return the file it names (the largest one of a directory)."""
    files = [checkpoint_path] if checkpoint_path.is_file() else \
        sorted((p for p in checkpoint_path.rglob("*") if p.is_file() and p.name != "manifest.json"),
               key=lambda p: p.stat().st_size)
    target = files[-1]
    data = bytearray(target.read_bytes())
    if how == "flip":  # one bit in the middle of the largest tensor's bytes: bit rot, a bad copy
        middle = len(data) // 2
        if zipfile.is_zipfile(target):  # (not in a zip's padding, which holds no data)
            member = max(zipfile.ZipFile(target).infolist(), key=lambda info: info.file_size)
            at = member.header_offset
            start = at + 30 + int.from_bytes(data[at + 26:at + 28], "little") + \
                int.from_bytes(data[at + 28:at + 30], "little")  # past the local header, its name and extra field
            middle = start + member.file_size // 2
        data[middle] ^= 0x10
        target.write_bytes(data)
    elif how == "truncate":  # a partial copy
        target.write_bytes(data[:len(data) - 100])
    elif how == "missing":
        target.unlink()
    elif how == "extra":  # a shard from another run copied in
        shutil.copy(target, target.with_name("__9_0.distcp"))
        return "__9_0.distcp"
    return target.name


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["singlex1", "plain", "ddpx2", "fsdpx2", "deepspeed_stage_2x2",
                                    "deepspeed_stage_3x2"])
@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "extra"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_never_loaded(saved, tmp_path, source, how):
    """Each format's checksums (the zip's CRCs of a file, manifest.json of a directory) are checked before a load
    uses the checkpoint; a clean copy of the same checkpoint loads."""
    if not (saved / source).exists():
        pytest.skip(f"{source} was not saved (DeepSpeed not installed)")
    name = "ckpt"
    original = saved / source / name
    if original.is_file() and how in ("missing", "extra"):
        pytest.skip("one file: nothing to lose or add beside it")
    copy = tmp_path / name
    (shutil.copytree if original.is_dir() else shutil.copy)(original, copy)
    assert Fabric(accelerator="cpu").load(copy)  # whole, it loads
    damaged = _damage(copy, how)
    with pytest.raises(CheckpointError) as refused:
        Fabric(accelerator="cpu").load(copy)
    message = str(refused.value)
    assert message.startswith(f"The checkpoint {copy} changed after it was saved") and "\n" not in message
    assert damaged in message or "the zip's end is missing" in message or "/data/" in message, message


def _hashed_at_a_save(fabric, path: str) -> dict:
    """The files under the staging folder this rank hashed while fabric.save wrote a directory checkpoint."""
    from core.checkpoint import integrity

    staging, real, seen = checkpoint.staging(Path(path)), integrity.digest, []

    def counted(file):
        seen.append(str(Path(file).relative_to(staging)))
        return real(file)
    layer = nn.Linear(64, 64)
    if fabric.strategy.joint_setup:  # DeepSpeed: one engine of both
        model, optimizer = fabric.setup(layer, torch.optim.Adam(layer.parameters()))
    else:  # fsdp: the optimizer over the sharded parameters
        model = fabric.setup_module(layer)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.randn(4, 64)).square().mean())
    optimizer.step()
    integrity.digest = counted
    try:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    finally:
        integrity.digest = real
    return {"rank": fabric.global_rank, "hashed": seen}


@pytest.mark.multiprocess
@pytest.mark.parametrize("family, own", [("fsdp", "__{rank}_"), ("deepspeed", "zero_pp_rank_{rank}_")])
def test_each_rank_hashes_the_files_it_wrote_and_rank_0_only_the_rest(two_ranks, tmp_path, family, own):
    """At a sharded save every rank hashes its own files for the manifest; rank 0 merges them and hashes what no
    rank wrote alone (state.pt, DCP's .metadata), so no rank reads the whole checkpoint; the manifest checks."""
    if family == "deepspeed":
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    path = tmp_path / "ckpt"
    ranks = two_ranks(family).run(_hashed_at_a_save, str(path))
    hashed = [set(rank["hashed"]) for rank in ranks]
    listed = set(json.loads((path / "manifest.json").read_text())["files"])
    assert hashed[0] | hashed[1] == listed and not hashed[0] & hashed[1], (hashed, listed)
    for rank, other in ((0, 1), (1, 0)):
        assert any(own.format(rank=rank) in name for name in hashed[rank]), hashed
        assert not any(own.format(rank=other) in name for name in hashed[rank]), hashed
    assert "state.pt" in hashed[0]
    assert checkpoint.integrity.problems(path) == ([], None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["fsdpx2", "deepspeed_stage_2x2"])
def test_a_directory_checkpoint_whose_manifest_was_deleted_is_refused(saved, tmp_path, source):
    """Its state.pt says the save wrote manifest.json, so without it the checkpoint is refused like a changed byte
    (not loaded as one saved before checksums existed)."""
    if not (saved / source).exists():
        pytest.skip(f"{source} was not saved (DeepSpeed not installed)")
    copy = tmp_path / "ckpt"
    shutil.copytree(saved / source / "ckpt", copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^The checkpoint {re.escape(str(copy))} changed after it was saved "
                                              r".*: manifest.json: missing, though its state.pt says the save wrote "
                                              r"one\. It was not loaded"):
        Fabric(accelerator="cpu").load(copy)


@pytest.mark.multiprocess
def test_a_checkpoint_saved_without_checksums_loads_with_a_note(saved, tmp_path, capfd):
    """What core wrote before it recorded checksums (a directory without manifest.json) and torch's legacy
    (non-zip) format still load, each with a one-line note."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved / "fsdpx2" / "ckpt", copy)
    (copy / "manifest.json").unlink()
    wrapper = torch.load(copy / "state.pt", weights_only=True)
    del wrapper["checksums"]  # as core wrote state.pt before it recorded checksums
    torch.save(wrapper, copy / "state.pt")
    assert Fabric(accelerator="cpu").load(copy)
    model = nn.Linear(4, 4)
    torch.save({"model": model.state_dict()}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    Fabric(accelerator="cpu").load(tmp_path / "legacy.pt", {"model": model})
    notes = capfd.readouterr().err.strip().splitlines()
    assert notes == [f"[core] {copy} holds no manifest.json (saved before core recorded checksums): loaded without "
                     f"checking its bytes.",
                     f"[core] {tmp_path / 'legacy.pt'} is not a zip (torch.save's legacy format, or another "
                     f"tool's): it holds no checksums: loaded without checking its bytes."]


@pytest.mark.multiprocess
def test_a_run_resumed_from_a_damaged_sharded_checkpoint_stops_with_one_line(tmp_path):
    """The user's path: an fsdp run on 2 processes, one bit of its largest shard flipped, then --resume naming that
    checkpoint: exit 2 and one line naming the shard (the ranks share out the checksums and refuse together in
    fabric.load), nothing trained."""
    run(["-m", "autoencoder.train", "--strategy", "fsdp", "--devices", "2", "--max-steps", "2", "--out",
         str(tmp_path / "run")], timeout=300)
    shard = _damage(tmp_path / "run" / "checkpoints" / "last.ckpt", "flip")
    result = run(["-m", "autoencoder.train", "--resume", str(tmp_path / "run" / "checkpoints" / "last.ckpt"),
                  "--max-steps", "4"], check=False, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert f"{shard}: does not match the checksum saved with it" in errors[0]
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1] <= 2


def test_resume_auto_skips_a_damaged_checkpoint_for_the_newest_kept_one_and_finishes_as_if_uninterrupted(tmp_path):
    """--keep-checkpoints 2 --checkpoint-every 2: steps 2 and 4 kept, last.ckpt the hard link of step 4's. Its bytes
    damaged (both names), --resume auto says what it skipped and why, goes on from step 2, and ends with the weights
    of a run never interrupted; when every kept checkpoint is damaged, it stops with one line."""
    flags = ["-m", "autoencoder.train", "--checkpoint-every", "2", "--keep-checkpoints", "2"]
    run([*flags, "--max-steps", "4", "--out", str(tmp_path / "run")], timeout=300)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-00000002.ckpt", "step-00000004.ckpt"]
    _damage(checkpoints / "last.ckpt", "flip")
    resumed = run([*flags, "--max-steps", "6", "--out", str(tmp_path / "run"), "--resume", "auto"], timeout=300)
    assert "[resume] skipped last.ckpt (its part" in resumed.stderr and \
        f"resuming from {checkpoints / 'step-00000002.ckpt'}" in resumed.stderr, resumed.stderr[-2000:]
    run([*flags, "--max-steps", "6", "--out", str(tmp_path / "straight")], timeout=300)
    weights = [torch.load(out / "checkpoints" / "last.ckpt")["model"] for out in (tmp_path / "run",
                                                                               tmp_path / "straight")]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[1])
    for path in [checkpoints / "last.ckpt", *checkpoints.glob("step-*.ckpt")]:
        _damage(path, "truncate")
    refused = run([*flags, "--max-steps", "8", "--out", str(tmp_path / "run"), "--resume", "auto"], check=False,
                  timeout=300)
    assert refused.returncode == 2 and "every checkpoint of the run changed after it was saved" in refused.stderr
    assert len([line for line in refused.stderr.splitlines() if "error:" in line]) == 1


def test_a_one_file_save_killed_mid_write_leaves_a_temporary_the_next_save_or_resume_clears(tmp_path):
    """atomic_write's `.NAME.tmp-PID` of a process that is gone is removed by the next save of that path and by a
    load (a resume); one of a live process (another writer) is left alone."""
    import subprocess
    import sys
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "last.ckpt"
    left = tmp_path / f".last.ckpt.tmp-{gone.stdout.strip()}"
    live = tmp_path / f".last.ckpt.tmp-{os.getppid()}"
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(2, 2))
    for clear in (lambda: fabric.save(path, {"model": model}), lambda: fabric.load(path, {"model": model})):
        left.write_bytes(b"half a checkpoint")
        live.write_bytes(b"")
        clear()
        assert not left.exists() and live.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB filesystem (tmpfs) at tmp_path/small: room for one of the autoencoder's checkpoints (3.8 MB), not two."""
    import subprocess
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here (as root it can): {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["single", "fsdp", "fsdp in the background", "deepspeed_stage_2"])
def test_a_full_disk_at_a_save_stops_every_rank_with_one_line_and_loses_nothing(small_disk, tmp_path, strategy):
    """The second save finds the disk full (on every rank under fsdp and DeepSpeed, whose files share it): exit 2,
    one line with the path, the space free and the size needed; the previous checkpoint whole, nothing partial
    left; moved to a disk with room, the run resumes from it. In the background, the save after it (the last)
    says so."""
    if strategy.startswith("deepspeed") and not _has_deepspeed():
        pytest.skip("needs the deepspeed extra")
    devices = [] if strategy == "single" else ["--strategy", strategy.split()[0], "--devices", "2"]
    devices += ["--save-in-background"] if strategy.endswith("background") else []
    result = run(["-m", "autoencoder.train", *devices, "--max-steps", "4", "--checkpoint-every", "2", "--out",
                  str(small_disk / "run")], check=False, timeout=300)
    errors = [line for line in result.stderr.split("\n") if "error:" in line]  # each a whole line, after the bar
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"python -m autoencoder.train: error: No space left to save the checkpoint "
                                f"{small_disk / 'run' / 'checkpoints' / 'last.ckpt'}: ") and \
        f"MB free on its filesystem, about {4 if strategy.startswith('deepspeed') else 3}." in errors[0] and \
        "The previous checkpoint is whole" in errors[0]  # (DeepSpeed's files: fp32 weights beside the module's)
    checkpoints = small_disk / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-00000002.ckpt"]  # no .tmp
    shutil.copytree(small_disk / "run", tmp_path / "moved")
    resumed = run(["-m", "autoencoder.train", "--resume", str(tmp_path / "moved"), "--max-steps", "4"], timeout=300)
    assert "at step 2" in resumed.stdout


def test_a_full_disk_at_a_one_file_save_is_one_error_and_keeps_the_previous_file(tmp_path, monkeypatch):
    """Without a small filesystem: ENOSPC put into the file write (torch's zip writer turns it into 'unexpected
    pos'), seen as lack of space, the temporary file removed, the previous checkpoint as it was."""
    import errno

    from core.checkpoint import space
    fabric = Fabric(accelerator="cpu")
    model = fabric.setup(nn.Linear(64, 64))
    fabric.save(tmp_path / "last.ckpt", {"model": model})
    before = (tmp_path / "last.ckpt").read_bytes()

    def full(self, data):
        self.error = OSError(errno.ENOSPC, "No space left on device")
        raise self.error
    monkeypatch.setattr(space.Recorder, "write", full)
    with pytest.raises(checkpoint.NoSpace, match=r"No space left to save the checkpoint .*last.ckpt: [\d.]+ MB free "
                                                 r"on its filesystem, about 0.0 MB needed"):
        fabric.save(tmp_path / "last.ckpt", {"model": model})
    assert (tmp_path / "last.ckpt").read_bytes() == before and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
