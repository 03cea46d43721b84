"""The local Slurm cluster that the launch, preemption and resume tests run on (tools/slurm_up.sh)."""

from __future__ import annotations

import re
import time

import pytest
from conftest import run

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def node_states() -> dict[str, str]:
    r = run(["sinfo", "-h", "-N", "-p", "normal", "-o", "%N %t"], timeout=30)
    return dict(line.split() for line in r.stdout.strip().splitlines())


def sacct_state(job_id: str, timeout: float = 60) -> str:
    """State of the job's allocation row in the accounting DB (it lags the job by a few seconds)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        r = run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], timeout=30)
        state = r.stdout.strip()
        if state and state not in ("PENDING", "RUNNING"):
            return state
        time.sleep(1)
    return state


def test_up_from_stopped_daemons_and_purged_state_within_two_minutes() -> None:
    down = run(["bash", "tools/slurm_down.sh", "--purge"], timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]
    assert run(["sinfo", "-h"], timeout=30).returncode != 0  # really down
    t0 = time.monotonic()
    up = run(["bash", "tools/slurm_up.sh"], timeout=180)
    elapsed = time.monotonic() - t0
    assert up.returncode == 0, up.stderr[-3000:]
    assert elapsed < 120, f"slurm_up took {elapsed:.0f} s"
    assert node_states() == {f"n{i}": "idle" for i in range(1, 5)}
    again = run(["bash", "tools/slurm_up.sh"], timeout=60)  # idempotent: a healthy cluster is left alone
    assert again.returncode == 0 and "starting" not in again.stderr


def test_partitions_for_normal_preemptible_and_high_priority_jobs() -> None:
    r = run(["scontrol", "show", "partition", "-o"], timeout=30)
    parts = {re.search(r"PartitionName=(\S+)", line).group(1): line for line in r.stdout.strip().splitlines()}
    assert set(parts) == {"normal", "preempt", "high", "gpu"}
    # gpu: simulated 8-GPU nodes for `sbatch --test-only sbatch/ppo_70b.sh`; DOWN, so nothing ever runs there
    assert "State=DOWN" in parts["gpu"] and "Default=YES" not in parts["gpu"]
    assert "Default=YES" in parts["normal"]
    assert "PreemptMode=REQUEUE" in parts["preempt"]
    tier = {name: int(re.search(r"PriorityTier=(\d+)", line).group(1)) for name, line in parts.items()}
    assert tier["high"] > tier["preempt"]
    conf = run(["scontrol", "show", "config"], timeout=30).stdout
    assert re.search(r"PreemptType\s*=\s*preempt/partition_prio", conf)
    assert re.search(r"JobRequeue\s*=\s*1", conf)


def test_sbatch_job_completes_and_sacct_records_it(tmp_path) -> None:
    script = tmp_path / "hello.sh"
    out = tmp_path / "hello.out"
    script.write_text("#!/bin/bash\n#SBATCH -N 2 -n 2 -t 2 --mem=200M\nsrun hostname\necho \"steps=$SLURM_NNODES\"\n")
    r = run(["sbatch", "--parsable", "--wait", "-o", str(out), str(script)], timeout=120)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    assert "steps=2" in out.read_text()
    assert sacct_state(job_id) == "COMPLETED"


def test_failed_job_is_recorded_as_failed(tmp_path) -> None:
    # without accounting, submitit sees a failed job as UNKNOWN; sacct must tell FAILED apart
    r = run(["sbatch", "--parsable", "--wait", "-t", "1", "--mem=100M", "-o", str(tmp_path / "f.out"),
             "--wrap", "exit 3"], timeout=120)
    assert r.returncode != 0
    job_id = r.stdout.strip().split(";")[0]
    assert sacct_state(job_id) == "FAILED"
