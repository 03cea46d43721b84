"""Preemption and resume: interrupted runs end with the same weights, byte for byte, as an uninterrupted one.

The reference is the session's uninterrupted GRPO run (conftest.grpo_reference: 10 steps, 4 workers,
TP=2, checkpoints every 4 steps). On the local Slurm cluster the same run (1 controller node + 2 nodes
x 2 workers: the same 4-rank layout) is
  - sent SIGUSR1 after step 3 (what `--signal=B:USR1@N` does before the time limit): the controller
    saves at the next step boundary, requeues the job itself, and the restarted job resumes;
  - preempted by a job on a higher-priority partition (PreemptMode=REQUEUE: TERM, grace, requeue).
Both must finish with the reference's final weights and optimizer state and the same per-step metrics.
Locally: a run that ends exactly at an epoch boundary and is continued runs the remaining steps.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import ARITH, HPCRL, TRAIN_OVERRIDES, TRAIN_STEPS, hpcrl_run, read_jsonl, run

SLURM_OVERRIDES = [*TRAIN_OVERRIDES, "algorithm.adv_estimator=grpo", "checkpoint.save_every=4",
                   "trainer.workers_per_node=2"]
# Wall-clock numbers and the processes' peak memory differ between runs; everything else in a step
# record must be identical.
TIMING = ("time/", "throughput/", "memory/")


def submit(run_dir: Path, partition: str) -> str:
    r = run([HPCRL, "submit", "--nodes", "2", "--partition", partition, "--json", "configs/grpo_tiny.yaml",
             f"trainer.run_dir={run_dir}", *SLURM_OVERRIDES], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(json.loads(r.stdout.strip().splitlines()[-1])["job_id"])


def steps_done(run_dir: Path) -> int:
    p = run_dir / "metrics.jsonl"
    return len(read_jsonl(p)) if p.exists() else 0


def wait_for(cond, timeout: float, what: str, job: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            q = subprocess.run(["squeue", "-j", job], capture_output=True, text=True).stdout
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; squeue:\n{q}")
        time.sleep(2)


def job_status(job: str) -> dict:
    """`hpcrl status JOB --json`: state, restarts and the het components' states (ID+0, ID+1)."""
    r = run([HPCRL, "status", job, "--json"], timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def finished(job: str, partition: str) -> bool:
    st = job_status(job)
    if st.get("state") == "PENDING":
        # this local cluster leaves a requeued hetjob pending for ~76 s until the partition is touched
        # (docs/slurm.md); a real scheduler's next cycle starts it. Touching it changes nothing else.
        subprocess.run(["scontrol", "update", f"PartitionName={partition}", "State=UP"], capture_output=True)
    comps = st.get("components") or []
    return len(comps) == 2 and all(c["state"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED",
                                                      "PREEMPTED") for c in comps)


def check_completed_after_restart(job: str) -> None:
    st = job_status(job)
    assert [c["state"] for c in st["components"]] == ["COMPLETED", "COMPLETED"], st
    assert st["restarts"] >= 1, st  # it really went through a requeue


def shard_digests(run_dir: Path, step: int) -> dict[str, str]:
    manifest = json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json").read_text())
    files = manifest["files"]
    items = files.items() if isinstance(files, dict) else ((f["path"], f) for f in files)
    return {path: rec["sha256"] for path, rec in items if path.startswith(("actor/", "rng/"))}


def same_records(a: list[dict], b: list[dict]) -> list[str]:
    """Differences between two runs' step records, timing metrics aside."""
    diffs = []
    for x, y in zip(a, b, strict=True):
        for k in sorted(set(x) | set(y)):
            if not k.startswith(TIMING) and x.get(k) != y.get(k):
                diffs.append(f"step {x['step']} {k}: {x.get(k)} != {y.get(k)}")
    return diffs


def check_same_as_reference(run_dir: Path, reference: tuple[Path, list[dict]]) -> None:
    ref_dir, ref_steps = reference
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in steps] == list(range(1, TRAIN_STEPS + 1)), "metrics lost or doubled across restarts"
    assert same_records(ref_steps, steps) == []
    ref, got = shard_digests(ref_dir, TRAIN_STEPS), shard_digests(run_dir, TRAIN_STEPS)
    assert any(p.endswith(".safetensors") for p in ref) and ref == got


def controller_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "controller.log").read_text()


@pytest.mark.slurm
def test_usr1_saves_requeues_and_resumes_bit_exact(slurm_cluster: None, grpo_reference: tuple[Path, list[dict]],
                                                    tmp_path: Path) -> None:
    run_dir = tmp_path / "usr1"
    job = submit(run_dir, "normal")
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 600, "step 3", job)
        r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: finished(job, "normal"), 900, "the job to finish", job)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    check_completed_after_restart(job)
    log = controller_log(run_dir)
    assert "signal SIGUSR1; checkpoint saved" in log and "requeued" in log and "resumed from" in log
    check_same_as_reference(run_dir, grpo_reference)


@pytest.mark.slurm
def test_preempted_by_higher_priority_job_resumes_bit_exact(slurm_cluster: None,
                                                            grpo_reference: tuple[Path, list[dict]],
                                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "preempted"
    job = submit(run_dir, "preempt")
    high = None
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 600, "step 3", job)
        # all 4 nodes, exclusively, on the high-priority partition: Slurm must preempt the run to start it
        r = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "4", "--exclusive", "--mem=100M", "-t", "2",
                            "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 2"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        high = r.stdout.strip().split(";")[0]
        wait_for(lambda: finished(job, "preempt"), 900, "the preempted job to finish", job)
    finally:
        subprocess.run(["scancel", job] + ([high] if high else []), capture_output=True)
    check_completed_after_restart(job)
    assert "resumed from" in controller_log(run_dir)
    check_same_as_reference(run_dir, grpo_reference)


def test_resume_at_epoch_boundary_runs_the_remaining_steps(tmp_path: Path) -> None:
    """24 prompts, 8 per step: an epoch is 3 steps. Stop exactly there, continue to 5 steps."""
    data = tmp_path / "train24.parquet"
    pq.write_table(pq.read_table(ARITH / "train.parquet").slice(0, 24), data)
    run_dir = tmp_path / "epoch"
    common = [f"data.train_files=[{data}]", "checkpoint.save_every=0"]
    first = hpcrl_run(run_dir, *common, "trainer.total_steps=3")
    assert [m["data/epoch"] for m in first] == [0, 0, 0]
    steps = hpcrl_run(run_dir, *common, "trainer.total_steps=5")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
    assert [m["data/epoch"] for m in steps] == [0, 0, 0, 1, 1]
    log = controller_log(run_dir)
    assert "resumed from" in log and "continuing at step 4 of 5" in log
