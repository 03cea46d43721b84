"""Checkpoint store (controller side), its CLI, and the offline layout conversion / HF export.

No MPI world here: the store is plain files, and the kill -9 tests SIGKILL a real save
(tests/programs/ckpt_slow_save.py writing and committing a 64 MB shard) at chosen moments.
The Megatron roles' save/load in a real world are in tests/test_checkpoint_world.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import IN_CI, PYTHON, REPO, run

from hpcrl.checkpoint import CheckpointError, CheckpointStore, DiskFullError
from hpcrl.checkpoint.files import file_record, write_durable
from hpcrl.checkpoint.store import LATEST, MANIFEST

SLOW_SAVE = str(REPO / "tests" / "programs" / "ckpt_slow_save.py")
BIG_MB = 64


def save(store: CheckpointStore, step: int, payload: bytes = b"w" * 1000) -> Path:
    """A small but complete save: one 'worker' shard and an RNG file, committed."""
    tmp = store.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "rng").mkdir()
    write_durable(tmp / "actor" / "pp0_tp0.safetensors", payload)
    write_durable(tmp / "rng" / "rank0.pt", b"rng" * 10)
    records = [[file_record(tmp / "actor" / "pp0_tp0.safetensors", tmp), file_record(tmp / "rng" / "rank0.pt", tmp)],
               None]
    return store.commit(tmp, step, records, {"step": step, "kl": 0.1}, "trainer:\n  seed: 1\n")


def steps(store: CheckpointStore) -> list[int]:
    return [i.step for i in store.list()]


# commit and manifest -----------------------------------------------------------------------------
def test_commit_writes_manifest_of_every_file_and_moves_latest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    path = save(store, 7)
    assert path == tmp_path / "ck" / "step_00000007"
    assert (tmp_path / "ck" / LATEST).read_text() == "step_00000007\n"
    m = json.loads((path / MANIFEST).read_text())
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(m["files"]) == on_disk == {"actor/pp0_tp0.safetensors", "rng/rank0.pt", "controller_state.json",
                                          "config.yaml"}
    assert m["step"] == 7 and m["total_bytes"] == sum(f["size"] for f in m["files"].values())
    assert store.verify(path) == []
    assert store.load_controller_state(path) == {"step": 7, "kl": 0.1}
    assert store.latest_valid(verify_checksums=True) == path
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]


def test_commit_refuses_files_that_do_not_match_the_records(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    save(store, 1)
    tmp = store.begin(2)
    write_durable(tmp / "stray.bin", b"x")
    with pytest.raises(CheckpointError, match="stray.bin"):  # written but never reported
        store.commit(tmp, 2, [], {}, "")
    tmp = store.begin(3)
    write_durable(tmp / "a.bin", b"abc")
    rec = file_record(tmp / "a.bin", tmp)
    write_durable(tmp / "a.bin", b"abcd")  # changed after its writer reported it
    with pytest.raises(CheckpointError, match="a.bin"):
        store.commit(tmp, 3, [rec], {}, "")
    with pytest.raises(CheckpointError, match="not a temporary folder"):
        store.commit(tmp, 4, [rec], {}, "")
    assert store.latest_valid() == tmp_path / "step_00000001"


# corrupt and partial checkpoints are never chosen ------------------------------------------------
def test_truncated_or_manifestless_checkpoints_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep_last=10)
    save(store, 1)
    p2 = save(store, 2)
    with open(p2 / "actor" / "pp0_tp0.safetensors", "r+b") as f:
        f.truncate(10)
    caplog.set_level(logging.WARNING, logger="hpcrl.checkpoint")
    assert store.latest_valid() == tmp_path / "step_00000001"
    assert "step_00000002" in caplog.text and "actor/pp0_tp0.safetensors: 10 bytes" in caplog.text
    # a folder under a step name without a manifest (e.g. copied by hand, half-way) is skipped too
    (tmp_path / "step_00000003" / "actor").mkdir(parents=True)
    (tmp_path / LATEST).write_text("step_00000003\n")
    caplog.clear()
    assert store.latest_valid() == tmp_path / "step_00000001"
    assert "step_00000003 (latest) is unusable" in caplog.text and "manifest.json missing" in caplog.text
    (tmp_path / LATEST).write_text("step_00000099\n")  # pointer to a folder that is gone
    assert store.latest_valid() == tmp_path / "step_00000001"


def test_corrupt_bytes_are_caught_by_checksums(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=10)
    save(store, 1)
    p2 = save(store, 2)
    f = p2 / "actor" / "pp0_tp0.safetensors"
    raw = bytearray(f.read_bytes())
    raw[500] ^= 0xFF  # same size, one flipped byte
    f.write_bytes(bytes(raw))
    assert store.latest_valid() == p2  # sizes alone cannot see it
    assert store.latest_valid(verify_checksums=True) == tmp_path / "step_00000001"
    assert store.verify(p2) == ["actor/pp0_tp0.safetensors: sha256 differs from the manifest (corrupt)"]


# retention -------------------------------------------------------------------------------------
def test_retention_keeps_last_k_and_every_mth(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=3)
    for s in range(1, 11):
        save(store, s)
    assert steps(store) == [3, 6, 9, 10]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no trash left behind
    plain = CheckpointStore(tmp_path / "plain", keep_last=1)
    for s in (5, 10):
        save(plain, s)
    assert steps(plain) == [10]


def test_retention_never_deletes_what_latest_points_to(tmp_path: Path) -> None:
    for s in (1, 2, 3):
        save(CheckpointStore(tmp_path, keep_last=3), s)
    (tmp_path / LATEST).write_text("step_00000001\n")  # rolled back by hand
    store = CheckpointStore(tmp_path, keep_last=1)
    assert [p.name for p in store.prune()] == ["step_00000002"]
    assert steps(store) == [1, 3]
    save(store, 4)  # a new commit moves the pointer: now the old one may go
    assert steps(store) == [4]


def test_same_step_saved_again_replaces_the_old_folder(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5)
    save(store, 4, b"old" * 100)
    save(store, 4, b"new" * 100)  # a run resumed from an older checkpoint reaches step 4 again
    assert (tmp_path / "step_00000004" / "actor" / "pp0_tp0.safetensors").read_bytes() == b"new" * 100
    assert steps(store) == [4] and store.verify(tmp_path / "step_00000004") == []


# kill -9 during a save --------------------------------------------------------------------------
def _start_slow_save(root: Path, step: int) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, SLOW_SAVE, str(root), str(step), str(BIG_MB)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return cond()
        time.sleep(0.002)
    return False


def _tmp_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def _assert_every_step_folder_is_complete(store: CheckpointStore) -> None:
    for info in store.list():
        assert store.verify(info.path, checksums=True) == [], info


def test_kill_during_shard_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    prev = save(store, 1)
    proc = _start_slow_save(tmp_path, 2)

    def mid_write() -> bool:
        files = [d / "actor" / "pp0_tp0.safetensors" for d in _tmp_dirs(tmp_path)]
        return any(f.is_file() and f.stat().st_size >= 8 << 20 for f in files)

    assert _wait_for(mid_write, proc), proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    shard = _tmp_dirs(tmp_path)[0] / "actor" / "pp0_tp0.safetensors"
    assert shard.stat().st_size < BIG_MB << 20  # really killed half-way through the file
    assert store.latest_valid(verify_checksums=True) == prev
    assert (tmp_path / LATEST).read_text() == "step_00000001\n" and steps(store) == [1]
    save(store, 3)  # the next commit removes the debris of the dead save
    assert _tmp_dirs(tmp_path) == [] and steps(store) == [1, 3]


def test_kill_at_every_stage_leaves_old_or_new_complete_checkpoint(tmp_path: Path) -> None:
    """SIGKILL the save at each stage one can observe from outside (folder created, shard a quarter
    and three quarters written, manifest written and being verified, folder renamed): afterwards
    every step folder is complete and latest_valid is the old checkpoint or the new one."""
    store = CheckpointStore(tmp_path, keep_last=100)
    prev = save(store, 1)
    big = BIG_MB << 20

    def shard_at(frac: float):
        return lambda: any((f := d / "actor" / "pp0_tp0.safetensors").is_file() and f.stat().st_size >= frac * big
                           for d in _tmp_dirs(tmp_path))

    stages = {"tmp folder": lambda: bool(_tmp_dirs(tmp_path)), "shard 25%": shard_at(0.25),
              "shard 75%": shard_at(0.75),
              "manifest": lambda: any((d / MANIFEST).is_file() for d in _tmp_dirs(tmp_path))}
    outcomes = {}
    for i, (stage, cond) in enumerate([*stages.items(), ("renamed", None)]):
        step = 10 + i
        new = tmp_path / f"step_{step:08d}"
        proc = _start_slow_save(tmp_path, step)
        assert _wait_for(cond or new.is_dir, proc), (stage, proc.communicate())
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        _assert_every_step_folder_is_complete(store)
        chosen = store.latest_valid(verify_checksums=True)
        assert chosen in (prev, new), (stage, chosen)
        if new.is_dir() and (tmp_path / LATEST).read_text().strip() == new.name:
            assert chosen == new
        outcomes[stage] = "new" if chosen == new else "old"
        prev = chosen
    # which side of the rename a late kill lands on depends on scheduling; an early one cannot
    # have reached it
    assert outcomes["tmp folder"] == "old", outcomes
    save(store, 50)
    assert store.latest_valid(verify_checksums=True) == tmp_path / "step_00000050"
    assert _tmp_dirs(tmp_path) == []  # the commit removed the debris of the killed saves


# disk full during a save ------------------------------------------------------------------------
@contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A real small file system at `path` (tmpfs of `size` bytes): its writes fail with ENOSPC."""
    # in CI (root, like the local Slurm cluster's set-up) these must run: a failure, not a skip
    refuse = pytest.fail if IN_CI else pytest.skip
    if os.geteuid() != 0:
        refuse("a full disk is made with `mount -t tmpfs`, which needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        refuse(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _shard(nbytes: int) -> Any:
    from hpcrl.checkpoint.megatron_state import ShardState

    return ShardState({"param::w": torch.zeros(nbytes // 4)}, {"layout": {"tp_rank": 0, "pp_rank": 0}})


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A 256 KiB tmpfs as the checkpoint folder: the first checkpoint fits, the second does not, at
    every place it can run out (refused up front, a worker's shard, the controller's files, the
    `latest` pointer). Each time: an error naming the path and the bytes, the partial save gone
    (its space back), no step folder or pointer for it, and the first checkpoint the latest valid."""
    from hpcrl.checkpoint.megatron_state import write_shard
    from hpcrl.checkpoint.rng import write_rng

    with tmpfs(tmp_path / "small", 256 << 10) as root:
        store = CheckpointStore(root, keep_last=2)
        first = save(store, 1, b"w" * 60_000)
        block = os.statvfs(root).f_frsize
        free = store.free_bytes()

        def unchanged() -> None:
            assert store.latest_valid(verify_checksums=True) == first and store.verify(first, checksums=True) == []
            assert steps(store) == [1] and store.read_latest() == "step_00000001"
            assert sorted(p.name for p in root.iterdir()) == [LATEST, first.name]  # no debris
            assert store.free_bytes() == free  # the partial files' space came back

        # refused before anything is written: the save's size against what is free
        with pytest.raises(DiskFullError) as e:
            store.check_space(2, 300_000)
        msg = str(e.value)
        assert str(root) in msg and "300000 bytes" in msg and f"only 0.2 MB ({free} bytes) free" in msg, msg
        assert "step_00000001 is intact" in msg
        unchanged()

        # a worker's shard runs out half-way (safetensors says so in its own error type)
        tmp = store.begin(2)
        with pytest.raises(DiskFullError) as e:
            write_shard(_shard(400_000), tmp, "actor")
        msg = str(e.value)
        assert f"no space left writing {tmp}/actor/pp0_tp0.safetensors (actor shard of TP rank 0, stage 0, ~0.4 MB (" \
            in msg and f"({free} bytes) free on its file system" in msg, msg
        assert not (tmp / "actor" / "pp0_tp0.safetensors").exists()  # the partial file is gone at once
        store.abandon(tmp)  # what the controller does once every writer returned
        unchanged()

        # the RNG file (torch.save into a full file says "unexpected pos", naming nothing)
        tmp = store.begin(2)
        write_durable(tmp / "filler", b"f" * store.free_bytes())
        with pytest.raises(DiskFullError, match=f"no space left writing {tmp}/rng/rank3.pt .RNG states of torch"):
            write_rng(tmp, 3, 4, {"torch": torch.get_rng_state()})
        assert not (tmp / "rng" / "rank3.pt").exists()
        store.abandon(tmp)
        unchanged()

        def worker_files(room: int) -> tuple[Path, list[Any]]:
            """A save whose worker files fit, leaving `room` bytes for the controller's files."""
            tmp = store.begin(2)
            (tmp / "actor").mkdir()
            f = tmp / "actor" / "pp0_tp0.safetensors"
            write_durable(f, b"x" * (store.free_bytes() - room))
            return tmp, [file_record(f, tmp)]

        # the controller's state file does not fit
        tmp, records = worker_files(0)
        with pytest.raises(DiskFullError) as e:
            store.commit(tmp, 2, records, {"step": 2}, "trainer:\n  seed: 1\n")
        msg = str(e.value)
        assert f"checkpoint of step 2 does not fit in {root}" in msg and f"writing {tmp}/controller_state.json" in msg
        assert f"the save needs ~0.2 MB ({records[0]['size']} bytes)" in msg and f"({free} bytes) are free" in msg
        unchanged()

        # everything fits but the new `latest`: the renamed folder is taken away again
        tmp, records = worker_files(3 * block)  # controller state, config, manifest: one block each
        with pytest.raises(DiskFullError, match=f"writing {root}/latest"):
            store.commit(tmp, 2, records, {"step": 2}, "trainer:\n  seed: 1\n")
        unchanged()

        # and with the space there, the next save commits as usual
        assert save(store, 3, b"w" * 60_000) == store.latest_valid() and steps(store) == [1, 3]


class _FakeGroup:
    """A trained group of one rank in this process, writing a real shard with the workers' code
    (write_shard / write_rng); async: the write happens at wait_checkpoint, as in the thread."""

    def __init__(self, nbytes: int) -> None:
        self.state = _shard(nbytes)
        self.pending: str | None = None

    def checkpoint_nbytes(self) -> list[int]:
        from hpcrl.checkpoint.megatron_state import shard_nbytes

        return [shard_nbytes(self.state) + 8192]

    def _write(self, ckpt_dir: str) -> list[Any]:
        from hpcrl.checkpoint.megatron_state import write_shard
        from hpcrl.checkpoint.rng import write_rng

        return write_shard(self.state, ckpt_dir, "actor") + write_rng(ckpt_dir, 0, 1, {"t": torch.get_rng_state()})

    def save_checkpoint(self, ckpt_dir: str, async_save: bool = False) -> list[Any]:
        if async_save:
            self.pending = ckpt_dir
            return [[]]
        return [self._write(ckpt_dir)]

    def wait_checkpoint(self) -> list[Any]:
        ckpt_dir, self.pending = self.pending, None
        return [self._write(ckpt_dir) if ckpt_dir else []]


class _State:
    def __init__(self) -> None:
        self.value: dict[str, int] = {}

    def state_dict(self) -> dict[str, int]:
        return dict(self.value)

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.value = dict(d)


SHARD = 100_000


class _FakePPOTrainer:
    """What train() needs of PPOTrainer, without workers: steps that change nothing, one group.
    At step 3 an operator frees the space a filler file took (`free_at_3`)."""

    free_at_3: Path | None = None

    def __init__(self, cfg: Any) -> None:
        self.step = 0
        self.sampler, self.kl_ctrl = _State(), _State()
        self.val_data = None
        self.group = _FakeGroup(SHARD)

    def trained_groups(self) -> list[_FakeGroup]:
        return [self.group]

    def train_step(self, step: int) -> dict[str, float]:
        if step == 3 and self.free_at_3 is not None:
            self.free_at_3.unlink()
        return {"actor/loss": 0.0}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("case", ["stop", "stop-async-write", "continue"])
def test_a_run_whose_checkpoint_does_not_fit_stops_with_status_4_or_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str) -> None:
    """train() with checkpoint.dir on a tmpfs that holds 3 checkpoints' shards, one taken by a
    filler file, keep_last=1: the save of step 2 does not fit. stop: exit status 4 with the error
    logged, step 1 the latest valid checkpoint. Async with the estimate passing (the disk filled
    after the check): the writer's error surfaces at finish_pending, same outcome. continue: a
    warning, training goes on, and once space is freed the final save of step 3 commits."""
    from omegaconf import OmegaConf

    from hpcrl.config.schema import HpcrlConfig
    from hpcrl.trainer import main as trainer_main

    with tmpfs(tmp_path / "small", 3 * SHARD // 4096 * 4096) as root:
        filler = root / "filler"
        write_durable(filler, b"f" * SHARD)
        monkeypatch.setattr(_FakePPOTrainer, "free_at_3", filler if case == "continue" else None)
        monkeypatch.setitem(sys.modules, "hpcrl.trainer.ppo", types.SimpleNamespace(PPOTrainer=_FakePPOTrainer))
        if case == "stop-async-write":  # another writer takes the space after the check
            monkeypatch.setattr(CheckpointStore, "check_space", lambda self, step, needed: None)
        cfg = OmegaConf.merge(OmegaConf.structured(HpcrlConfig), {
            "trainer": {"run_dir": str(tmp_path / "run"), "total_steps": 3},
            "logging": {"tensorboard": False},
            "checkpoint": {"dir": str(root / "checkpoints"), "save_every": 1, "keep_last": 1,
                           "async_save": case == "stop-async-write", "on_save_error": case.split("-")[0]}})
        caplog.set_level(logging.INFO)
        sigterm = signal.getsignal(signal.SIGTERM)  # train() installs its preemption handler
        try:
            status = trainer_main.train(cfg)
        finally:
            signal.signal(signal.SIGTERM, sigterm)
        store = CheckpointStore(root / "checkpoints")
        assert not _tmp_dirs(root / "checkpoints")
        failed = "checkpoint of step 2 not saved: "
        if case == "continue":
            assert status == 0 and store.latest_valid() == store.find(3) and steps(store) == [3], caplog.text
            assert "Training goes on (checkpoint.on_save_error=continue)" in caplog.text
            assert "checkpoints of steps [2] could not be saved" in caplog.text
        else:
            assert status == trainer_main.SAVE_FAILED_EXIT == 4, caplog.text
            assert store.latest_valid(verify_checksums=True) == store.find(1) and steps(store) == [1]
            assert "Exit status 4" in caplog.text and "step 1 of 3" not in caplog.text
            if case == "stop":
                assert f"{failed}checkpoint of step 2 needs ~" in caplog.text and str(root) in caplog.text
                assert "stopping after step 2 of 3: the checkpoint of step 2 could not be saved" in caplog.text
            else:
                assert f"{failed}no space left writing {root}/checkpoints/.tmp-step_00000002-" in caplog.text
                assert "/actor/pp0_tp0.safetensors" in caplog.text
                assert "stopping after step 3 of 3: the checkpoint of step 2 could not be saved" in caplog.text
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == {"stop": 2, "stop-async-write": 2, "continue": 3}[case]


# the CLI ---------------------------------------------------------------------------------------
def ckpt_cli(*args: str) -> subprocess.CompletedProcess:
    return run([PYTHON, "-m", "hpcrl.cli_ckpt", "ckpt", *args], timeout=120)


def test_cli_list_and_verify_exit_codes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    store = CheckpointStore(run_dir / "checkpoints", keep_last=5)
    save(store, 5)
    p10 = save(store, 10)
    store.begin(15)  # an unfinished save
    r = ckpt_cli("list", str(run_dir))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.split()[0] == "5" and "yes" in ln and "latest" not in ln for ln in lines)
    assert any(ln.split()[0] == "10" and "yes" in ln and "<- latest" in ln for ln in lines)
    assert ".tmp-step_00000015" in r.stdout and "unfinished" in r.stdout
    r = ckpt_cli("verify", str(run_dir))
    assert r.returncode == 0 and r.stdout.count(": OK") == 2, r.stdout
    f = p10 / "actor" / "pp0_tp0.safetensors"
    f.write_bytes(b"W" + f.read_bytes()[1:])
    r = ckpt_cli("verify", str(run_dir))
    assert r.returncode == 1 and "step_00000010: CORRUPT" in r.stdout and "actor/pp0_tp0.safetensors" in r.stdout
    assert ckpt_cli("verify", str(run_dir), "--step", "5").returncode == 0
    assert ckpt_cli("verify", str(p10)).returncode == 1  # a checkpoint folder given directly
    r = ckpt_cli("verify", str(run_dir), "--step", "7")
    assert r.returncode == 2 and "no checkpoint of step 7" in r.stderr
    assert ckpt_cli("list", str(tmp_path / "nowhere")).returncode == 2


# offline conversion between layouts and HF export ------------------------------------------------
def _arch(tie: bool):
    from hpcrl.engines.megatron.model import ModelArch

    # vocab 501 is padded to 512 at TP=2: the conversion must drop and re-add the padding rows
    return ModelArch(architecture="Qwen2ForCausalLM", vocab_size=501, hidden_size=32, ffn_hidden_size=48,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=64, tie_word_embeddings=tie, qkv_bias=True)


def _hf_tensors(arch, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f, hd = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    t = {"model.embed_tokens.weight": torch.randn(arch.vocab_size, h, generator=g),
         "model.norm.weight": torch.randn(h, generator=g)}
    if not arch.tie_word_embeddings:
        t["lm_head.weight"] = torch.randn(arch.vocab_size, h, generator=g)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                  "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
                  "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
                  "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h),
                  "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
        t.update({p + k: torch.randn(*s, generator=g) for k, s in shapes.items()})
    return t


KINDS = ("param", "exp_avg", "exp_avg_sq")


def _write_saved_role(ckpt: Path, role: str, arch, hf: dict[str, dict[str, torch.Tensor]], tp: int, pp: int,
                      value_head: bool = False) -> None:
    """What MegatronEngine ranks would write at TP x PP, built from HF tensors with hf_to_megatron."""
    from hpcrl.checkpoint.megatron_state import ShardState, write_shard
    from hpcrl.engines.megatron.convert import hf_to_megatron

    for p in range(pp):
        for t in range(tp):
            tensors, names = {}, []
            for kind in KINDS:
                shard = hf_to_megatron(arch, hf[kind].__getitem__, t, tp, p, pp, "local", lm_head=not value_head)
                if value_head and p == pp - 1:
                    shard["output_layer.weight"] = hf[kind]["value_head.weight"]
                    shard["output_layer.bias"] = hf[kind]["value_head.bias"]
                names = list(shard)
                tensors.update({f"{kind}::{n}": v for n, v in shard.items()})
            tensors.update({f"step::{n}": torch.tensor(3.0) for n in names})
            meta = {"format": "hpcrl-megatron-shard/1", "role": role, "spec": "local", "dtype": "float32",
                    "layout": {"tp": tp, "pp": pp, "dp": 1, "tp_rank": t, "pp_rank": p}, "value_head": value_head,
                    "arch": asdict(arch), "model_path": str(ckpt / "model"), "step_count": 3, "params": names,
                    "master": False, "optimizer": {"per_element": ["exp_avg", "exp_avg_sq"], "scalar": ["step"],
                                                   "step": 3.0, "step_dtype": "float32", "other": {},
                                                   "param_groups": [{"lr": 1e-3}]}}
            write_shard(ShardState(tensors, meta), ckpt, role)


@pytest.mark.parametrize("tie", [True, False])
def test_saved_shards_reslice_exactly_into_any_layout(tmp_path: Path, tie: bool) -> None:
    from hpcrl.checkpoint.megatron_state import SavedRole
    from hpcrl.engines.megatron.convert import hf_to_megatron

    arch = _arch(tie)
    hf = {k: _hf_tensors(arch, seed) for seed, k in enumerate(KINDS)}
    _write_saved_role(tmp_path, "actor", arch, hf, tp=2, pp=2)
    saved = SavedRole(tmp_path / "actor")
    assert saved.kinds() == list(KINDS) and (saved.tp, saved.pp) == (2, 2)
    for tp, pp in [(1, 1), (2, 1), (1, 4)]:
        for kind in KINDS:
            for p in range(pp):
                for t in range(tp):
                    want = hf_to_megatron(arch, hf[kind].__getitem__, t, tp, p, pp, "local")
                    got = hf_to_megatron(arch, saved.hf_getter(kind), t, tp, p, pp, "local")
                    assert got.keys() == want.keys()
                    for k in want:
                        assert torch.equal(got[k], want[k]), (tp, pp, kind, k)


def test_critic_value_head_travels_apart_from_the_lm_layers(tmp_path: Path) -> None:
    from hpcrl.checkpoint.export import export_hf
    from hpcrl.checkpoint.megatron_state import SavedRole

    arch = _arch(False)
    hf = {k: _hf_tensors(arch, seed) for seed, k in enumerate(KINDS)}
    for seed, k in enumerate(KINDS):
        hf[k]["value_head.weight"] = torch.full((1, arch.hidden_size), float(seed + 1))
        hf[k]["value_head.bias"] = torch.full((1,), float(seed + 1))
    _write_saved_role(tmp_path, "critic", arch, hf, tp=2, pp=2, value_head=True)
    saved = SavedRole(tmp_path / "critic")
    for kind in KINDS:
        head = saved.value_head_tensors(kind)
        assert torch.equal(head["output_layer.weight"], hf[kind]["value_head.weight"])
        assert "lm_head.weight" not in saved.unit_hf(kind, 1, "final")  # the value head is no LM head
        assert torch.equal(saved.hf_getter(kind)("model.layers.3.mlp.up_proj.weight"),
                           hf[kind]["model.layers.3.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="value head"):
        export_hf(tmp_path, tmp_path / "out", role="critic", model_path=str(tmp_path))


def test_export_hf_joins_shards_into_the_original_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from hpcrl.checkpoint.export import export_hf

    arch = _arch(True)
    hf = {k: _hf_tensors(arch, seed) for seed, k in enumerate(KINDS)}
    ckpt = tmp_path / "step_00000003"
    _write_saved_role(ckpt, "actor", arch, hf, tp=2, pp=2)
    model = ckpt / "model"  # the recorded model path: config and tokenizer come from there
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"not copied")
    info = export_hf(ckpt, tmp_path / "hf", max_shard_bytes=30_000)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert info["files"] > 1 and f"model-00001-of-{info['files']:05d}.safetensors" in files
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(files)
    assert "model.safetensors" not in files
    got = {}
    for f in files:
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "hf" / f)))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert got.keys() == hf["param"].keys() == index["weight_map"].keys()  # tied: no lm_head
    assert all(torch.equal(got[k], hf["param"][k]) for k in got)
    with pytest.raises(FileExistsError):
        export_hf(ckpt, tmp_path / "hf")


def test_rank_seed_is_stable_and_distinct() -> None:
    from hpcrl.checkpoint.rng import rank_seed

    # stable: a resumed job is a new process, where Python's salted hash() would differ
    code = "from hpcrl.checkpoint.rng import rank_seed; print(rank_seed(1, 10, 0), rank_seed(3, 7, 5))"
    others = {subprocess.run([PYTHON, "-c", code], env=dict(os.environ, PYTHONHASHSEED=str(h)), cwd=REPO,
                             capture_output=True, text=True, check=True).stdout for h in (1, 2)}
    assert others == {f"{rank_seed(1, 10, 0)} {rank_seed(3, 7, 5)}\n"}
    assert len({rank_seed(1, 10, r) for r in range(64)} | {rank_seed(1, 11, 0), rank_seed(2, 10, 0)}) == 66



class _RunsCode:
    """What a crafted checkpoint file holds: an object whose unpickling calls a function."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    from hpcrl.checkpoint.rng import read_rng_file

    marker, evil = tmp_path / "pwned", tmp_path / "rank0.pt"
    torch.save({"world_size": 1, "state": _RunsCode(marker)}, evil)
    with pytest.raises(CheckpointError, match="rank0.pt: refused to load"):
        read_rng_file(evil)
    assert not marker.exists()
    # the payload is real: a plain unpickle runs it
    torch.load(evil, weights_only=False)
    assert marker.exists()
    # what hpcrl saves loads
    torch.save({"world_size": 2, "state": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)}}, evil)
    assert read_rng_file(evil)["world_size"] == 2


def test_a_crafted_queue_of_batches_generated_ahead_is_refused(tmp_path: Path) -> None:
    """The controller's file of a one-step-off checkpoint (hpcrl.trainer.ahead) loads tensors and plain
    containers only; a pickle that runs code is refused and runs nothing."""
    from hpcrl.controller.batch import Batch
    from hpcrl.trainer.ahead import QUEUE_FILE, Generated, RolloutsAhead

    marker = tmp_path / "pwned"
    torch.save([{"step": 3, "tensors": _RunsCode(marker)}], tmp_path / QUEUE_FILE)
    with pytest.raises(CheckpointError, match=f"{QUEUE_FILE}: refused to load"):
        RolloutsAhead(1).load(tmp_path)
    assert not marker.exists()
    # what hpcrl saves loads back the same
    ahead = RolloutsAhead(1)
    ahead.queue.append(Generated(4, [7, 9], Batch({"input_ids": torch.arange(6).view(2, 3)}), torch.tensor([0.5, 1.0]),
                                 {"reward/acc": 0.5}, 2))
    (record,) = ahead.save(tmp_path)
    assert record["path"] == QUEUE_FILE and record["size"] == (tmp_path / QUEUE_FILE).stat().st_size
    again = RolloutsAhead(1)
    again.load(tmp_path)
    (g,) = again.queue
    assert (g.step, g.indices, g.version, g.metrics) == (4, [7, 9], 2, {"reward/acc": 0.5})
    assert torch.equal(g.batch["input_ids"], torch.arange(6).view(2, 3))
    assert torch.equal(g.scores, ahead.queue[0].scores)


# batches generated ahead (hpcrl.trainer.ahead): what is generated, and what a resume does with them
class _AheadLoop:
    """The split placement's loop as PPOTrainer drives RolloutsAhead: next_batch before the update,
    the in-flight batch collected after it. The engines' weights at step s are those after s - 1 (the
    version a batch started at step s records); a batch's prompts are the next row of a counter (the
    sampler), or the rows it is regenerated from. Records what was generated and trained."""

    def __init__(self, ahead: Any, total: int) -> None:
        self.ahead, self.total = ahead, total
        self.next_row = 0
        self.generated: list[tuple[int, list[int], int]] = []  # (for step, rows, version)
        self.trained: list[tuple[int, list[int], int]] = []  # (step, rows, staleness)

    def run(self, first: int, last: int) -> None:
        from hpcrl.controller.batch import Batch
        from hpcrl.trainer.ahead import Generated

        for step in range(first, last + 1):
            def start(at: int, rows: list[int] | None, version: int = step - 1) -> Any:
                if rows is None:
                    rows, self.next_row = [self.next_row], self.next_row + 1
                self.generated.append((at, rows, version))
                return lambda: Generated(at, rows, Batch({"input_ids": torch.tensor([rows])}), torch.zeros(1), {},
                                         version)

            if self.ahead.depth or self.ahead.queue:
                item = self.ahead.next_batch(step, self.total, start)
            else:  # the synchronous loop (PPOTrainer.rollout) draws and generates the step's batch
                item = start(step, None)()
            assert item.step == step
            self.trained.append((step, item.indices, step - 1 - item.version))
            if self.ahead.in_flight is not None:  # collect_ahead, after the update
                self.ahead.queue.append(self.ahead.in_flight())
                self.ahead.in_flight = None


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_nothing_is_generated_past_the_last_step(depth: int) -> None:
    """rollout.max_staleness = depth: every step trains on a batch at most `depth` steps stale, and no
    batch is generated (nor its prompts drawn) for a step past trainer.total_steps. Before, a start
    filled the queue and the loop kept it full up to depth - 1 batches past the end: generated,
    scored, drawn from the sampler and saved in the last checkpoint, never trained on."""
    from hpcrl.trainer.ahead import RolloutsAhead

    loop = _AheadLoop(RolloutsAhead(depth), total=6)
    loop.run(1, 6)
    assert [g[0] for g in loop.generated] == [1, 2, 3, 4, 5, 6]
    assert loop.next_row == 6 and not loop.ahead.queue  # 6 prompt batches drawn, none left over
    assert [t[1] for t in loop.trained] == [[0], [1], [2], [3], [4], [5]]
    # the first batches come from the start's weights, then each is `depth` steps stale
    assert [t[2] for t in loop.trained] == [min(s - 1, depth) for s in range(1, 7)]


@pytest.mark.parametrize("new_depth", [0, 1])
def test_a_resume_with_smaller_staleness_regenerates_the_staler_batches(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, new_depth: int) -> None:
    """A run generating 3 steps ahead is stopped after step 4 (its checkpoint holds the batches of steps
    5-7, each to be 3 steps stale) and resumed with rollout.max_staleness = 1 or 0. The saved batches
    that would be staler than the new bound are regenerated from the same prompts with the current
    weights, each with a warning; no prompt is skipped or repeated, and no step trains on a batch
    staler than the new bound. Before, they were trained on as they were."""
    from hpcrl.trainer.ahead import RolloutsAhead

    first = _AheadLoop(RolloutsAhead(3), total=10)
    first.run(1, 4)
    assert [g.step for g in first.ahead.queue] == [5, 6, 7]
    first.ahead.save(tmp_path)
    resumed = _AheadLoop(RolloutsAhead(new_depth), total=10)
    resumed.ahead.load(tmp_path)
    resumed.next_row = first.next_row  # the sampler's position, from the checkpoint
    caplog.set_level(logging.WARNING, logger="hpcrl.trainer")
    resumed.run(5, 10)
    rows = [r for t in first.trained + resumed.trained for r in t[1]]
    assert rows == list(range(10))  # every prompt once, in order
    assert max(t[2] for t in resumed.trained) <= new_depth, resumed.trained
    regenerated = [g for g in resumed.generated if g[0] <= 7]
    assert [(g[0], g[1]) for g in regenerated] == [(5, [4]), (6, [5]), (7, [6])]  # the saved prompts, again
    assert caplog.text.count("more than rollout.max_staleness") == 3, caplog.text
    assert (f"the batch of step 5 was generated with the weights after step 1 (3 step(s) stale), more than "
            f"rollout.max_staleness={new_depth} allows: regenerating its 1 prompts with the current weights"
            in caplog.text), caplog.text
    # the control: resumed with the depth it was saved with, the saved batches are trained as they are
    same = _AheadLoop(RolloutsAhead(3), total=10)
    same.ahead.load(tmp_path)
    same.next_row = first.next_row
    same.run(5, 10)
    assert [g[0] for g in same.generated] == [8, 9, 10] and [t[2] for t in same.trained][:3] == [3, 3, 3]


def test_the_disk_space_check_counts_the_batches_generated_ahead(tmp_path: Path) -> None:
    """The checkpoint's up-front space check (Checkpointer.needed_bytes) includes the controller's file
    of batches generated ahead, at least its size on disk. Before, it was left out."""
    from omegaconf import OmegaConf

    from hpcrl.config.schema import HpcrlConfig
    from hpcrl.controller.batch import Batch
    from hpcrl.trainer.ahead import Generated, RolloutsAhead
    from hpcrl.trainer.main import Checkpointer

    class _TrainerWithQueue(_FakePPOTrainer):
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self.ahead = RolloutsAhead(1)

        def controller_files_nbytes(self) -> int:  # as PPOTrainer's
            return self.ahead.nbytes()

    cfg = OmegaConf.merge(OmegaConf.structured(HpcrlConfig), {"checkpoint": {"dir": str(tmp_path / "ckpt")}})
    trainer = _TrainerWithQueue(cfg)
    ckpt = Checkpointer(cfg, trainer, types.SimpleNamespace(cursor=lambda: 0))
    state = ckpt.controller_state()
    empty = ckpt.needed_bytes(state, "x")
    assert trainer.ahead.nbytes() == 0
    ids = torch.randint(0, 1000, (64, 512))
    trainer.ahead.queue.append(Generated(2, list(range(16)), Batch({"input_ids": ids, "attention_mask": ids * 0 + 1}),
                                         torch.zeros(64), {}, 0))
    (record,) = trainer.ahead.save(tmp_path)
    assert trainer.ahead.nbytes() == record["size"] > 500_000
    assert ckpt.needed_bytes(state, "x") - empty >= record["size"]
