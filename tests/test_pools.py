"""Rollout pools (hpcrl.pools): a worker of another process joins a running split, fully asynchronous run,
gets its weights, generates part of every segment, dies in the middle of a step, and the run finishes
with every prompt trained once; and the refusals (another config, a run that is not running).

One local run of the tiny model (at most 50 short steps) and one pool job on the local Slurm cluster, submitted
with `hpcrl submit --join` (1 node x 2 workers): worker 0 SIGKILLs itself as its 100th segment arrives
(HPCRL_FAULT, hpcrl.launch.faults: what the run sees is a kill -9 from outside at a known moment, a
segment in flight), then the test cancels the job with scancel. Once the run has trained 3 steps more on its
own engines it is stopped by SIGTERM (it saves at the step boundary and exits 0): the ~12 steps it ran after
that to reach 50 checked nothing more and cost ~40 CPU-s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import FULLY_ASYNC, HPCRL, REPO, TRAIN_OVERRIDES, hf_token_logprobs, hpcrl_cli, read_jsonl, run
from omegaconf import OmegaConf
from test_resume import steps_done

from hpcrl.pools.wire import MAX_FRAME_BYTES, Channel, fingerprint_differences

STEPS = 50  # at most: the pool job needs ~30 steps of the run to start on the loaded CI box
# the run's own rollout: 1 worker beside its 2 trainer workers (TP=2). What it generates while the pool job
# starts (~60 s in CI) is CPU the pool's workers wait for; one engine of its own is enough to show them join
OWN_ENGINES = ["trainer.workers_per_node=3", "trainer.rollout_workers=1"]
BATCH_PROMPTS = 8  # configs/grpo_tiny.yaml data.train_batch_size


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a real loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def test_channel_carries_json_frames_and_refuses_oversized_ones() -> None:
    a, b = tcp_pair()
    left, right = Channel(a, 5.0), Channel(b, 5.0)
    msgs = [{"type": "generate", "seq": i, "requests": [[[1, 2, 3], 2**61 + i, 4]], "lp": [-0.1 * i, -1e-300]}
            for i in range(50)]
    for m in msgs:
        left.send(m)
    got = []
    while len(got) < len(msgs):
        got.append(right.recv(5.0))
    assert got == msgs  # JSON round-trips ints of 62 bits and floats exactly
    a.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"{}")
    with pytest.raises(ConnectionError, match="a frame of"):
        right.recv(5.0)
    left.close()
    right.close()
    a2, b2 = tcp_pair()
    Channel(a2, 1.0).close()
    with pytest.raises(ConnectionError, match="closed"):
        Channel(b2, 1.0).poll()


def test_fingerprint_differences_name_each_key() -> None:
    run_fp = {"architecture": {"hidden_size": 64}, "rollout.temperature": 1.0, "model.dtype": "float32"}
    assert fingerprint_differences(run_fp, dict(run_fp)) == []
    pool_fp = {**run_fp, "rollout.temperature": 0.5, "architecture": {"hidden_size": 128}}
    assert fingerprint_differences(run_fp, pool_fp) == [
        "architecture: run {'hidden_size': 64}, pool {'hidden_size': 128}", "rollout.temperature: run 1.0, pool 0.5"]


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.mark.slurm
def test_pool_job_joins_gets_weights_leaves_mid_step_and_every_prompt_trains_once(
        slurm_cluster: None, tmp_path: Path) -> None:
    d = tmp_path / "run"
    env = {**os.environ, "HPCRL_JOB_REGISTRY": str(tmp_path / "jobs.jsonl")}
    out = open(tmp_path / "run.out", "w")
    proc = subprocess.Popen([HPCRL, "run", "configs/grpo_tiny.yaml", f"trainer.run_dir={d}", *TRAIN_OVERRIDES,
                             *FULLY_ASYNC, *OWN_ENGINES, "rollout.segment_tokens=1", "rollout.max_new_tokens=48",
                             f"trainer.total_steps={STEPS}", "checkpoint.save_every=1",
                             f"checkpoint.keep_last={STEPS}"],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    job = None
    try:
        _wait(lambda: (d / "pools" / "controller.json").is_file(), proc, tmp_path, 300)
        # a worker whose sampling differs is refused before it builds anything, naming the key
        r = run([HPCRL, "pool", str(d), "rollout.temperature=0.5"], timeout=120)
        assert r.returncode == 2 and "rollout.temperature: run 1.0, pool 0.5" in r.stderr, (r.returncode, r.stderr)
        r = run([HPCRL, "submit", "--join", str(d), "--rollout-nodes", "1", "configs/grpo_tiny.yaml",
                 "rollout.temperature=0.5"], timeout=120, env=env)  # refused before sbatch, naming the key
        assert r.returncode == 2 and "rollout.temperature: run 1.0, pool 0.5" in r.stderr, (r.returncode, r.stderr)
        # a pool job of 1 node x 2 workers; worker 0 SIGKILLs itself as its 100th segment arrives (a segment in
        # flight), then the job is cancelled (worker 1 in the middle of a step). The two workers become ready
        # together but may go live an update apart: with the 40th segment (~3 s after going live) worker 0 was
        # once gone before worker 1 got its first weights, and no step saw both (a check-up run, 2026-12-07)
        r = run([HPCRL, "submit", "--join", str(d), "--rollout-nodes", "1", "--time", "10", "--json",
                 "trainer.workers_per_node=2"], timeout=120, env={**env, "HPCRL_FAULT": "0:-1:pool_segment:100"})
        assert r.returncode == 0, r.stderr + r.stdout
        job = json.loads(r.stdout)["job_id"]
        log = Path(json.loads(r.stdout)["stdout"])
        _wait(lambda: log.is_file() and "SIGKILL at call 100 of pool_segment" in log.read_text(), proc, tmp_path, 400)
        status = run([HPCRL, "status", str(d)])
        assert re.search(rf"pool {job}: 2 worker\(s\): 1 gone, 1 live", status.stdout), status.stdout
        assert run(["scancel", job]).returncode == 0
        cancelled_at = steps_done(d)
        # 3 steps more on the run's own engines (the cancelled worker may still serve the first), then SIGTERM
        # (what scancel or a preemption sends): the controller saves at the step boundary and exits 0
        _wait(lambda: steps_done(d) >= min(cancelled_at + 3, STEPS), proc, tmp_path, 600)
        (rank0_log,) = (d / "logs").glob("rank0.*.log")  # the controller's file names its pid
        if proc.poll() is None:  # (not already at its last step)
            os.kill(int(re.search(r"start pid=(\d+)", rank0_log.read_text()).group(1)), signal.SIGTERM)
        assert proc.wait(timeout=900) == 0, (tmp_path / "run.out").read_text()[-6000:]
    finally:
        if job is not None:
            run(["scancel", job])
        if proc.poll() is None:
            proc.kill()
        out.close()
    steps = read_jsonl(d / "metrics.jsonl")
    stopped = len(steps)
    assert min(cancelled_at + 3, STEPS) <= stopped <= STEPS
    assert [m["step"] for m in steps] == list(range(1, stopped + 1))
    workers = [int(m["rollout/workers"]) for m in steps]
    joined = next(i for i, w in enumerate(workers) if w > 1) + 1  # the first step after whose update a pool
    # worker held the weights
    # they joined after step 1, left (worker 0, then the cancelled job's worker 1, at most one step apart), and
    # the run ended on its own engine
    assert joined >= 2 and max(workers) == 3 and workers[-1] == 1 and set(workers[joined:]) <= {1, 2, 3}, workers
    pool_tokens = [m["pools/tokens_generated"] for m in steps]
    assert sum(pool_tokens) > 0 and all(t == 0 for t in pool_tokens[:joined]), pool_tokens
    # worker 0's share of the segment in flight when it died was lost and given to the others (and worker
    # 1's, unless the cancel found it between segments)
    assert sum(m["pools/parts_lost"] for m in steps) in (1, 2), [m["pools/parts_lost"] for m in steps]
    for m in steps:  # the tokens the trainer's current weights made match its log-probs
        assert m["stream/gap_current_version_max"] < 1e-4, (m["step"], m["stream/gap_current_version_max"])
    # From outside the run: every token a pool worker made that a checkpoint's stream holds (samples in flight,
    # saved each step) has the log-prob HF computes with the exported weights of the version recorded for it:
    # the workers ran each update's weights. (Tested control: a worker that received the weights without
    # loading them failed this, its tokens made by the model file's weights.)
    held: dict[int, dict[tuple[int, ...], list[tuple[int, float]]]] = {}
    for step in range(joined, stopped + 1):
        state = torch.load(d / "checkpoints" / f"step_{step:08d}" / "stream.pt", weights_only=True)
        for g in state["groups"]:
            for smp in g["samples"]:
                ids = tuple(g["prompt"] + smp["tokens"])
                for t, (v, lp, pooled) in enumerate(zip(smp["versions"], smp["logprobs"], smp["pooled"], strict=True)):
                    if pooled:
                        held.setdefault(v, {}).setdefault(ids, []).append((len(g["prompt"]) + t, lp))
    assert held and min(held) >= joined, sorted(held)
    temperature = OmegaConf.load(d / "config.yaml").rollout.temperature
    worst, checked = {}, 0
    for v, seqs in sorted(held.items()):
        model = tmp_path / f"v{v}"
        r = hpcrl_cli("ckpt", "export-hf", str(d), "--step", str(v), "--out", str(model))
        assert r.returncode == 0, r.stderr[-3000:]
        order = list(seqs)
        width = max(map(len, order))
        lp = hf_token_logprobs(model, {"input_ids": torch.tensor([list(q) + [0] * (width - len(q)) for q in order]),
                                       "attention_mask": torch.tensor([[1] * len(q) + [0] * (width - len(q))
                                                                       for q in order])}, temperature)
        worst[v] = max(abs(float(lp[i, pos]) - rec) for i, q in enumerate(order) for pos, rec in seqs[q])
        checked += sum(len(x) for x in seqs.values())
    print("pool tokens: |HF - recorded| per version:", worst, "tokens:", checked)
    assert max(worst.values()) < 1e-4, worst
    # every prompt trained exactly once (those in flight at the stop are in the checkpoint's stream)
    rows = [r for m in steps for r in m["data/prompt_rows"]]
    assert len(rows) == stopped * BATCH_PROMPTS and len(set(rows)) == len(rows)
    r = run([HPCRL, "status", str(d)])
    assert r.returncode == 0 and f"not running, step {stopped}" in r.stdout, r.stdout
    assert r.stdout.count("connection lost") == 2, r.stdout
    # joining a run that is not running: exit 2 saying so, nothing in the run directory changed
    before = _tree(d)
    for cmd in ([HPCRL, "pool", str(d)], [HPCRL, "submit", "--join", str(d), "--rollout-nodes", "1"]):
        r = run(cmd, timeout=120, env=env)
        assert r.returncode == 2 and "start the run first" in r.stderr, (cmd, r.returncode, r.stderr)
    assert _tree(d) == before


def _wait(done, proc: subprocess.Popen, tmp_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, (tmp_path / "run.out").read_text()[-4000:]
        assert time.monotonic() < deadline, (tmp_path / "run.out").read_text()[-4000:]
        time.sleep(0.5)


def test_registry_refuses_a_wrong_token_and_drops_a_silent_worker_after_the_liveness_bound(tmp_path: Path) -> None:
    """The controller's side with real connections: a hello with another token is refused; a worker
    that says hello and then nothing is declared gone once rollout.pool_liveness_s has passed, and its
    share of a segment comes back with no tokens (the stream then gives those samples to other engines)."""
    from hpcrl.engines.vllm.engine import SamplingSettings
    from hpcrl.pools.registry import PoolRegistry
    from hpcrl.pools.wire import find_controller

    fp = {"rollout.temperature": 1.0}
    reg = PoolRegistry(str(tmp_path), fp, liveness_s=1.0)
    info = find_controller(tmp_path)
    try:
        wrong = Channel(socket.create_connection(("127.0.0.1", info["port"])), 5.0)
        wrong.send({"type": "hello", "token": "0" * 32, "pool": "p", "index": 0, "fingerprint": fp})
        silent = Channel(socket.create_connection(("127.0.0.1", info["port"])), 5.0)
        silent.send({"type": "hello", "token": info["token"], "pool": "p", "index": 1, "fingerprint": fp})
        deadline = time.monotonic() + 5
        while len(reg.members) < 1 or reg.greeting:
            reg.poll()
            assert time.monotonic() < deadline
        assert wrong.recv(5.0)["reason"].startswith("wrong or missing token")
        assert silent.recv(5.0) == {"type": "welcome", "member": "p/1#1"}
        (member,) = reg.members.values()
        member.state, member.version = "live", None  # as after a weight load (none here)
        reg.version = None
        part = reg.start_part(member, [([1, 2], 7, 4), ([3], 8, 4)], SamplingSettings())
        msg = silent.recv(5.0)
        while msg["type"] == "heartbeat":  # the controller's own, every quarter of the bound
            msg = silent.recv(5.0)
        assert msg["type"] == "generate" and msg["requests"] == [[[1, 2], 7, 4], [[3], 8, 4]], msg
        t0 = time.monotonic()
        while not part.done():  # the worker never answers
            assert time.monotonic() - t0 < 5.0, "the silent worker was not dropped"
            time.sleep(0.01)
        waited = time.monotonic() - t0
        completions = part.result()
        assert 0.9 < waited < 3.0, waited
        assert [(c.token_ids, c.finish_reason) for c in completions] == [([], "length"), ([], "length")]
        assert member.state == "gone" and member.why_gone.startswith("silent for") and reg.step_metrics()[
            "pools/parts_lost"] == 1
        state = json.loads((tmp_path / "pools" / "state.json").read_text())
        assert [(w["member"], w["state"]) for w in state["workers"]] == [("p/1#1", "gone")]
    finally:
        reg.close()
    assert not (tmp_path / "pools" / "controller.json").exists() and not (tmp_path / "pools" / "token").exists()
