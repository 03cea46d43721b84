"""Slurm launch: `hpcrl submit` (submitit hetjob), sbatch/ppo_70b.sh, `hpcrl status` / `hpcrl cancel`, quoting.

The Slurm part runs against the real local cluster (tools/slurm_up.sh) with as few jobs as possible: the
module fixture submits two training jobs at once (each ~1 min of the tiny model on a quiet machine, 4-5 min
on the loaded 2-core CI box; they run one after the other since each takes 3 of the 4 nodes):

- A: `hpcrl submit --nodes 2 configs/grpo_tiny.yaml` for 3 steps, its run named with `$(touch ...)`, quotes,
  backticks, `;` and spaces (the run dir, job name and log paths carry the name), under a folder with a space;
- B: `sbatch [group 0 options] : [group 1 options] sbatch/ppo_70b.sh <tiny overrides>`: PPO with a critic
  (GAE) on the tiny model, 2 worker nodes x 1 worker (DP=2 for actor and critic), CPU.

Before them, one short job (~30 s) checks that USR1 and TERM reach the controller and that `hpcrl cancel`
works. Everything else is cheap: `--test-only` of the 70B script, a held dry-run script, unit checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HPCRL, REPO, run

TINY_PPO_OVERRIDES = [
    "model.path=models/tiny-qwen2", "model.dtype=fp32",
    "data.train_files=[data/arith/train.parquet]", "data.val_files=[data/arith/val.parquet]",
    "data.max_prompt_length=128", "data.train_batch_size=8", "data.val_batch_size=8",
    "actor.parallel.tensor_parallel=1", "actor.parallel.pipeline_parallel=1", "actor.parallel.data_parallel=null",
    "actor.ppo_mini_batch_size=8", "actor.micro_batch_tokens=2048", "actor.offload=false",
    "critic.parallel.tensor_parallel=1", "critic.parallel.pipeline_parallel=1", "critic.parallel.data_parallel=null",
    "critic.ppo_mini_batch_size=8", "critic.micro_batch_tokens=2048",
    "rollout.tensor_parallel=1", "rollout.n=2", "rollout.max_new_tokens=16", "rollout.weight_bucket_mb=16",
    "trainer.nnodes=2", "trainer.workers_per_node=1", "trainer.device=cpu", "trainer.total_steps=2",
    "trainer.val_every=0", "trainer.timeout_s=300", "checkpoint.save_every=0", "checkpoint.async_save=false",
    "slurm.partition=normal", "slurm.gpus_per_node=0",
]
# sbatch options that turn the 70B allocation into the local cluster's: group 0 before ':', group 1 after
TINY_PPO_SBATCH = ["--partition=normal", "--cpus-per-task=1", "--mem=3G", "--time=30", ":",
                   "--partition=normal", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=3G",
                   "--gpus-per-node=0", "--oversubscribe"]
JOB_DEADLINE_S = 25 * 60  # per job, generous: the CI box runs other tests beside these


def _sacct_components(job_id: str) -> dict[str, str]:
    r = run(["sacct", "-j", job_id, "--parsable2", "--noheader", "-o", "JobID,State"], timeout=60)
    rows = dict(line.split("|", 1) for line in r.stdout.splitlines() if "|" in line)
    return {k: v for k, v in rows.items() if "." not in k}


def _wait_done(job_id: str, deadline: float) -> None:
    pending_since = None
    while time.monotonic() < deadline:
        q = run(["squeue", "-h", "-j", job_id, "-o", "%T %P"], timeout=60)
        if not q.stdout.strip():
            return
        # this local cluster can leave a hetjob pending (reason None) on idle nodes until the partition is
        # touched (docs/slurm.md; seen for a job submitted into a run dir whose last job had just ended);
        # a real scheduler's next cycle starts it, and touching it changes nothing else
        state, partition = (q.stdout.split() + ["", ""])[:2]
        pending_since = (pending_since or time.monotonic()) if state == "PENDING" else None
        if pending_since is not None and time.monotonic() - pending_since > 15:
            run(["scontrol", "update", f"PartitionName={partition}", "State=UP"], timeout=60)
            pending_since = None
        time.sleep(3)
    run(["scancel", job_id], timeout=60)
    pytest.fail(f"job {job_id} did not finish in {JOB_DEADLINE_S} s")


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path} missing)"


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _events(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["event"] for line in path.read_text().splitlines() if line.strip()]


def _wait_for(pred, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


# in the environment of every job here: it must reach no file of a run (job script, logs, config)
FAKE_WANDB_KEY = "hpcrl-test-fake-wandb-key-in-a-job-5c0e27"


@pytest.fixture(scope="module")
def env_registry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A private job registry for this module (the CLI and, through sbatch's environment, the jobs use
    it), and a W&B key that sbatch passes on to the jobs."""
    reg = tmp_path_factory.mktemp("registry") / "jobs.jsonl"
    return {**os.environ, "HPCRL_JOB_REGISTRY": str(reg), "WANDB_API_KEY": FAKE_WANDB_KEY}


@pytest.fixture(scope="module")
def jobs(slurm_cluster: None, tmp_path_factory: pytest.TempPathFactory,
         env_registry: dict[str, str]) -> Iterator[dict[str, object]]:
    """Submit A (hpcrl submit, dangerous name) and B (sbatch ppo_70b.sh, tiny), wait for both."""
    base = tmp_path_factory.mktemp("submit") / "dir with space"
    base.mkdir()
    # every command the name could run creates a file that exists nowhere yet (a unique name), in a
    # folder with a short path: the name must stay under safe_job_name's 200 characters whatever the
    # depth of pytest's temporary folder (at /tmp/pytest-of-root/pytest-101 it reached 201 and was cut)
    marker_dir = Path(tempfile.mkdtemp(prefix="hpcrl-pw-", dir="/tmp"))
    marker = marker_dir / "pwned"
    name = f'$(touch {marker}1) "q" s p\'x`touch {marker}2`;y $(touch {marker}3)'
    assert len(name) < 200, name
    t0 = time.monotonic()
    # the split placement on nodes of its own: trainer node (TP=2) + rollout node (one TP=2 engine), synchronous
    a = run([HPCRL, "submit", "--nodes", "1", "--rollout-nodes", "1", "--json", "configs/grpo_tiny.yaml",
             "trainer.total_steps=3", "trainer.workers_per_node=2", "trainer.val_every=0", "rollout.max_staleness=0",
             "rollout.tensor_parallel=2", "algorithm.rollout_correction=tis", f"trainer.experiment={name}",
             f"trainer.run_dir={base}/runs/${{trainer.experiment}}"], timeout=300, env=env_registry)
    assert a.returncode == 0, a.stderr + a.stdout
    sub_a = json.loads(a.stdout)
    ppo_dir = base / "ppo run"
    ppo_log = base / "ppo-%j.out"
    b = run(["sbatch", "--parsable", f"--output={ppo_log}", *TINY_PPO_SBATCH, "sbatch/ppo_70b.sh",
             *TINY_PPO_OVERRIDES, "trainer.experiment=ppo tiny", f"trainer.run_dir={ppo_dir}"],
            timeout=120, env=env_registry)
    assert b.returncode == 0, b.stderr
    job_b = b.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 2 * JOB_DEADLINE_S
    try:
        _wait_done(sub_a["job_id"], deadline)
        t_a = time.monotonic() - t0
        _wait_done(job_b, deadline)
    finally:
        run(["scancel", sub_a["job_id"], job_b], timeout=60)  # no-op once they are done
    print(f"job A {sub_a['job_id']} done after {t_a:.0f} s, job B {job_b} after {time.monotonic() - t0:.0f} s")
    yield {"a": sub_a, "name": name, "marker": marker, "base": base,
           "b": job_b, "ppo_dir": ppo_dir, "ppo_log": Path(str(ppo_log).replace("%j", job_b))}
    shutil.rmtree(marker_dir, ignore_errors=True)


# ---------------------------------------------------------------- on the local cluster
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_signals_reach_the_controller_and_cancel(tmp_path: Path, env_registry: dict[str, str]) -> None:
    """USR1 for the batch process (what --signal=B:USR1 does) and TERM reach the controller; hpcrl cancel.

    Runs first, alone (~30 s): a controller program that records signals (tests/programs/slurm_signal_probe.py),
    submitted by `hpcrl submit --target`, 1 worker node x 2 workers.
    """
    run_dir = tmp_path / "probe run"
    probe = run_dir / "probe.jsonl"
    r = run([HPCRL, "submit", "--json", "--nodes", "1", "--target", "tests/programs/slurm_signal_probe.py",
             "configs/grpo_tiny.yaml", "trainer.workers_per_node=2", f"trainer.run_dir={run_dir}"],
            env=env_registry, timeout=300)
    assert r.returncode == 0, r.stderr
    sub = json.loads(r.stdout)
    job = sub["job_id"]
    try:
        _wait_for(lambda: "ready" in _events(probe), "the probe's worker group", JOB_DEADLINE_S)
        ready = json.loads(probe.read_text().splitlines()[0])
        assert len(ready["workers"]) == 2 and ready["argv"][0] == str(run_dir / "slurm" / "config.yaml")
        # the launcher's MPICH netmod for Slurm's pmi2 reached the ranks (why: hpcrl/launch/commands.py)
        assert {w["netmod"] for w in ready["workers"]} == {"ofi"}, ready["workers"]
        assert run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
        _wait_for(lambda: "SIGUSR1" in _events(probe), "USR1 at the controller", 60)
        c = run([HPCRL, "cancel", job], env=env_registry)
        assert c.returncode == 0, c.stderr
        _wait_for(lambda: not run(["squeue", "-h", "-j", job]).stdout.strip(), "the job to end", 120)
    finally:
        run(["scancel", job])
    assert _events(probe) == ["ready", "SIGUSR1", "SIGTERM"], _tail(Path(sub["stderr"]))
    err = Path(sub["stderr"]).read_text(errors="replace")
    assert re.search(r"\[hpcrl slurm\] got SIGUSR1 at \d\d:\d\d:\d\d: forwarded to srun", err), err[-3000:]
    assert {s.split()[0] for s in _sacct_components(job).values()} == {"CANCELLED"}  # "CANCELLED by 0"
    st = run([HPCRL, "status", job, "--json"], env=env_registry)
    assert st.returncode == 0 and json.loads(st.stdout)["state"] == "CANCELLED", st.stdout + st.stderr
    assert run([HPCRL, "cancel", "--user=root"], env=env_registry).returncode == 2  # never handed to scancel
    assert run([HPCRL, "status", "987654321"], env=env_registry).returncode == 3


@pytest.mark.slurm
def test_submit_moe_runs_two_steps_then_resumes_on_a_node_range(jobs: dict, moe_ep2: tuple[Path, list[dict]],
                                                                 tmp_path: Path, env_registry: dict[str, str]) -> None:
    """hpcrl submit configs/grpo_tiny_moe.yaml (tiny Qwen3-MoE, TP=2 SP, routing replay) after the jobs above:
    a copy of the session's MoE run (conftest.moe_ep2: its first 2 steps, trained locally at EP=2 on 2 workers,
    with the fp32 rollout-vs-actor gap after each sync) submitted with `hpcrl submit --nodes 1-2` resumes from
    its step-2 checkpoint on what Slurm grants and trains step 3 at the config's layout with routing replay
    (EP=1: the experts' files of both EP ranks converted), within fp32 rounding of the fixture's own step 3
    (measured 2.9e-8 relative at most at TP=2 DP=2; with the fixture's rollout TP and no load-balancing loss,
    whose term is a micro-batch's, so another DP gives another term). One Slurm job: the 2 steps before it
    are the fixture's (a job of its own for them cost ~100 s), and the same resume run locally cost a world."""
    from test_resume import resumable_copy

    src, src_steps = moe_ep2
    run_dir = resumable_copy(src, tmp_path / "moe", 2)
    assert [m["step"] for m in src_steps[:2]] == [1, 2]
    assert all(m["rollout_actor_logprob_gap_max"] < 1e-4 and m["actor/moe/replayed_share"] > 0.9
               for m in src_steps[:2]), src_steps
    # the run directory submitted on whatever Slurm grants of 1-2 nodes x 2 workers (the fixture had 1 x 2, at EP=2):
    # it resumes from step 2 and trains step 3 with the DP the allocation gives
    r = run([HPCRL, "submit", "--nodes", "1-2", "--json", "configs/grpo_tiny_moe.yaml", "trainer.total_steps=3",
             "trainer.val_every=0", "trainer.workers_per_node=2", "rollout.tensor_parallel=2",
             "actor.moe.aux_loss_coeff=0", f"trainer.run_dir={run_dir}"], timeout=300, env=env_registry)
    assert r.returncode == 0, r.stderr + r.stdout
    sub = json.loads(r.stdout)
    assert "#SBATCH --nodes=1-2" in Path(sub["submission_file"]).read_text()
    try:
        _wait_done(sub["job_id"], time.monotonic() + JOB_DEADLINE_S)
    finally:
        run(["scancel", sub["job_id"]], timeout=60)
    err = Path(sub["stderr"]).read_text(errors="replace")
    assert set(_sacct_components(sub["job_id"]).values()) == {"COMPLETED"}, _tail(Path(sub["stderr"]))
    granted = re.search(r"\[hpcrl slurm\] granted (\d) worker node\(s\) x 2 task\(s\): actor TP=2 PP=1 DP=(\d) SP", err)
    assert granted and int(granted.group(2)) == int(granted.group(1)), err[-3000:]
    assert _steps(run_dir) == [1, 2, 3]
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "resumed from" in log and f"actor TP=2 PP=1 DP={granted.group(2)} SP, MoE 8 experts" in log, log[-3000:]
    last, straight = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1]), src_steps[-1]
    assert last["rollout_actor_logprob_gap_max"] < 1e-4 and last["actor/moe/replayed_share"] > 0.9, last
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/moe/load_balancing_loss"):
        assert last[k] == pytest.approx(straight[k], rel=1e-5, abs=1e-7), (k, last[k], straight[k])


@pytest.mark.slurm
def test_submit_grpo_hetjob_completes(jobs: dict, env_registry: dict[str, str]) -> None:
    """hpcrl submit --nodes 1 --rollout-nodes 1 configs/grpo_tiny.yaml, 3 steps: the three het components
    (controller, trainer node, rollout node) COMPLETED, 3 steps of metrics; after every weight transfer
    from the trainer's node, the engine's log-probs equal the trainer's."""
    sub = jobs["a"]
    job, run_dir, folder = sub["job_id"], Path(sub["run_dir"]), Path(sub["folder"])
    logs = _tail(Path(sub["stdout"])) + _tail(Path(sub["stderr"]))
    assert _sacct_components(job) == {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED", f"{job}+2": "COMPLETED"}, logs
    assert _steps(run_dir) == [1, 2, 3], logs
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["time/transfer"] > 0 and "weights/sent_mb" in m for m in steps)
    # each rank of the TP=2 engine received only the half of the model it keeps. By hand (tiny model,
    # vLLM's cut): per layer q 64x128 + k, v 32x128 each + o 128x64 + q, k, v biases 64 + 32 + 32 +
    # gate, up 256x128 each + down 128x256 + 2 norms of 128 = 123264; 2 layers + half the embedding
    # 256x128 (the tied LM head is its alias) + the final norm 128 = 279424 fp32 parameters, of 558208
    assert all(m["weights/received_mb_max"] == 4 * 279424 / 1e6 and m["weights/model_mb"] == 4 * 558208 / 1e6
               for m in steps), [(m["weights/received_mb_max"], m["weights/model_mb"]) for m in steps]
    assert max(m["rollout_actor_logprob_gap_max"] for m in steps) < 1e-4, [m["rollout_actor_logprob_gap_max"]
                                                                             for m in steps]
    assert "--het-group=0,1,2" in Path(sub["stderr"]).read_text(errors="replace")
    assert folder == run_dir / "slurm" and (folder / "job.json").is_file() and (folder / "config.yaml").is_file()
    script = Path(sub["submission_file"]).read_text()
    assert script.count("#SBATCH hetjob") == 2 and "#SBATCH --signal=B:USR1@300" in script
    assert "#SBATCH --requeue" in script and "#SBATCH --open-mode=append" in script
    assert "[hpcrl slurm] srun exited with status 0" in Path(sub["stderr"]).read_text(errors="replace")
    # quiet job log: the step lines; each rank's library output in its own file of the run
    out = Path(sub["stdout"]).read_text(errors="replace")
    assert sum(f"step {n}/3 | reward " in out for n in (1, 2, 3)) == 3, out[-3000:]
    assert sorted(p.name.split(".")[0] for p in (run_dir / "logs").glob("rank*.log")) == [
        f"rank{r}" for r in range(5)], sorted(p.name for p in (run_dir / "logs").iterdir())
    # the W&B key of the job's environment is in none of its files (batch script, pickles, logs, config)
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and FAKE_WANDB_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked
    st = run([HPCRL, "status", job, "--json"], env=env_registry)
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["state"] == "COMPLETED" and status["step"] == 3 and status["restarts"] == 0
    assert status["run_dir"] == str(run_dir)
    assert [c["state"] for c in status["components"]] == ["COMPLETED", "COMPLETED", "COMPLETED"]
    human = run([HPCRL, "status", job], env=env_registry)
    assert "COMPLETED" in human.stdout and "step 3" in human.stdout


@pytest.mark.slurm
def test_dangerous_run_name_runs_and_executes_nothing(jobs: dict) -> None:
    """A run named with $(touch ...), backticks, quotes, ; and spaces submits and runs; nothing is executed."""
    sub, name, marker = jobs["a"], jobs["name"], jobs["marker"]
    run_dir = Path(sub["run_dir"])
    assert run_dir == jobs["base"] / "runs" / name  # the name reached the file system verbatim
    assert not list(marker.parent.glob(f"{marker.name}*"))
    info = json.loads((run_dir / "slurm" / "job.json").read_text())
    assert info["job_name"] == name and info["restart_count"] == 0
    # sacct keeps the name after slurmctld has forgotten the job (scontrol may no longer show it);
    # slurmdbd stores a double quote as a backquote (measured: `"q"` comes back as `` `q` ``)
    acct = run(["sacct", "-j", sub["job_id"], "-n", "--parsable2", "-o", "JobID,JobName"], timeout=60)
    names = dict(line.split("|", 1) for line in acct.stdout.splitlines() if "|" in line)
    stored = name.replace('"', "`")
    assert names.get(f"{sub['job_id']}+0") == stored and names.get(f"{sub['job_id']}+1") == stored, acct.stdout
    assert Path(sub["stdout"]).parent == run_dir / "slurm"


@pytest.mark.slurm
def test_ppo_70b_script_runs_tiny_ppo(jobs: dict, env_registry: dict[str, str]) -> None:
    """sbatch sbatch/ppo_70b.sh with tiny overrides: a short PPO (GAE, critic) run completes."""
    job, run_dir = jobs["b"], jobs["ppo_dir"]
    log = _tail(jobs["ppo_log"])
    assert _sacct_components(job) == {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}, log
    assert _steps(run_dir) == [1, 2], log
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert any(k.startswith("critic/") for k in first), sorted(first)
    info = json.loads((run_dir / "slurm" / "job.json").read_text())
    assert info["job_id"] == job and info["worker_nodes"]
    st = run([HPCRL, "status", job, "--json"], env=env_registry)  # found through the registry (plain sbatch)
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["state"] == "COMPLETED" and status["step"] == 2 and status["run_dir"] == str(run_dir)


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_ppo_70b_script_accepted_with_its_70b_settings(env_registry: dict[str, str]) -> None:
    """`sbatch --test-only sbatch/ppo_70b.sh`: 1 + 32 nodes, 8 GPUs per worker node (simulated partition);
    the same for the batch script `hpcrl submit configs/ppo_70b.yaml` would submit."""
    r = run(["sbatch", "--test-only", "sbatch/ppo_70b.sh"], timeout=60)
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr
    dry = run([HPCRL, "submit", "--dry-run", "--skip-path-checks", "configs/ppo_70b.yaml"], env=env_registry)
    assert dry.returncode == 0, dry.stderr
    script = dry.stdout.split("\n# the batch step")[0]
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --nodes=32" in script
    r = run(["sbatch", "--test-only"], input=script, timeout=60)
    assert r.returncode == 0 and "to start at" in r.stderr, r.stderr


def test_node_range_is_checked_at_every_count(tmp_path: Path, env_registry: dict[str, str]) -> None:
    """`--nodes MIN-MAX`: Slurm may grant any count in it, so each must give a usable layout; the range
    goes into the workers' het group and the job's own arguments leave trainer.nnodes to the allocation."""
    base = [HPCRL, "submit", "--dry-run", "configs/grpo_tiny.yaml", f"trainer.run_dir={tmp_path}/r"]
    ok = run([*base, "--nodes", "1-2"], env=env_registry)
    assert ok.returncode == 0, ok.stderr
    script, job_args = ok.stdout.split("\n# the batch step")
    assert script.split("#SBATCH hetjob")[1].count("#SBATCH --nodes=1-2") == 1 and "trainer.nnodes" not in job_args
    # 3 nodes x 4 workers at TP=2: DP=6 does not divide the mini-batch of 16
    bad = run([*base, "--nodes", "1-3"], env=env_registry)
    assert bad.returncode == 2, bad.stderr
    assert ("--nodes 1-3: Slurm may grant any count in the range, and the layout cannot use 3 node(s) (at 3: "
            "actor.ppo_mini_batch_size=16") in bad.stderr and "Counts that work: 1, 2." in bad.stderr, bad.stderr
    for arg, why in (("3-1", "the range's end is below its start"), ("two", "give a node count (4) or a range")):
        r = run([*base, "--nodes", arg], env=env_registry)
        assert r.returncode == 2 and why in r.stderr, r.stderr
    r = run([*base, "--nodes", "1-2", "trainer.nnodes=2"], env=env_registry)
    assert r.returncode == 2 and "leave trainer.nnodes out" in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_submit_dry_run_script_is_quoted(tmp_path: Path, env_registry: dict[str, str]) -> None:
    """The batch script: hetjob block, USR1 signal, quoted paths; sbatch parses the directives as written."""
    name = "a b 'c' \"d\" $(e) `f` g;h hetjob"  # "hetjob" inside a value must not split the job
    r = run([HPCRL, "submit", "--dry-run", "--nodes", "2", "--partition", "normal", "--no-requeue",
             "configs/grpo_tiny.yaml", f"trainer.experiment={name}", f"trainer.run_dir={tmp_path}/x y/{name}"],
            env=env_registry)
    assert r.returncode == 0, r.stderr
    script = r.stdout.split("\n# the batch step")[0]
    assert "\n#SBATCH hetjob\n" in script and "#SBATCH --no-requeue" in script
    assert "exec " in script and "-m submitit.core._submit" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    held = run(["sbatch", "--parsable", "--hold", "--output=/dev/null"], input=script, timeout=60)
    assert held.returncode == 0, held.stderr  # Slurm takes the directives (nothing can run: held, then cancelled)
    job = held.stdout.strip().split(";")[0]
    try:
        shown = run(["scontrol", "show", "job", job]).stdout
    finally:
        run(["scancel", job])
    assert f"JobName={name}" in shown and "HetJobOffset=1" in shown and "Requeue=0" in shown
    assert "HetJobOffset=2" not in shown
    assert not (tmp_path / "x y").exists()  # a dry run writes nothing


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_submit_refuses_bad_config_before_submitting(env_registry: dict[str, str]) -> None:
    r = run([HPCRL, "submit", "--nodes", "3", "configs/grpo_tiny.yaml", "actor.parallel.tensor_parallel=3"],
            env=env_registry)
    assert r.returncode == 2 and "actor.parallel.tensor_parallel=3" in r.stderr, r.stderr
    r = run([HPCRL, "submit", "--time", "soon", "configs/grpo_tiny.yaml"], env=env_registry)
    assert r.returncode == 2 and "slurm.time" in r.stderr, r.stderr


# ---------------------------------------------------------------- no cluster needed
def test_parse_slurm_time() -> None:
    from hpcrl.launch.slurm_query import parse_slurm_time

    assert [parse_slurm_time(t) for t in ("30", "1:30", "04:00:00", "2-00:00:00", "1-2", "1-0:1", "0:0:1")] == \
        [30, 2, 240, 2880, 1560, 1441, 1]
    for bad in ("soon", "1:2:3:4", "0", "-5", ""):
        with pytest.raises(ValueError):
            parse_slurm_time(bad)


def test_override_values_survive_yaml_and_interpolation() -> None:
    from hpcrl.config import load_config
    from hpcrl.launch.allocation import override

    weird = "/r/a: b #c 'd' \"e\" [f] {g} $(h) `i` - j"
    cfg = load_config("configs/grpo_tiny.yaml", [override("trainer.run_dir", weird)])
    assert cfg.trainer.run_dir == weird and cfg.checkpoint.dir == weird + "/checkpoints"


def test_sbatch_directives_quote_or_refuse() -> None:
    from hpcrl.launch.submit import check_directive_value, safe_job_name, sbatch_directive

    assert sbatch_directive("job_name", "it's") == "#SBATCH --job-name='it'\"'\"'s'"
    assert sbatch_directive("requeue", True) == "#SBATCH --requeue"
    for bad in ("a\\b", "a\nb", "a\rb"):
        with pytest.raises(ValueError):
            check_directive_value(bad, "x")
    assert safe_job_name("a\\b\nc") == "a_b_c"


def test_hetjob_states_fold_from_sacct_rows() -> None:
    """sacct rows as measured for a requeued hetjob (job 51 on the local cluster)."""
    from hpcrl.launch.slurm_query import parse_sacct, status_from_sacct
    from hpcrl.launch.submit import HetSlurmInfoWatcher

    text = "\n".join([
        "51+0|REQUEUED|00:00:06|0:0|n1|2026-11-29T22:01:21|2026-11-29T22:01:27|normal|rq",
        "51+0.batch|CANCELLED|00:00:06|0:15|n1|2026-11-29T22:01:21|2026-11-29T22:01:27||batch",
        "51+1|REQUEUED|00:00:06|0:0|n[2-3]|2026-11-29T22:01:21|2026-11-29T22:01:27|normal|rq",
        "51+0|RUNNING|00:00:40|0:0|n1|2026-11-29T22:02:42|Unknown|normal|rq | with a pipe",
        "51+0.batch|RUNNING|00:00:40|0:0|n1|2026-11-29T22:02:42|Unknown||batch",
        "51+1|FAILED|00:00:40|1:0|n[2-3]|2026-11-29T22:02:42|Unknown|normal|rq | with a pipe",
    ])
    st = status_from_sacct("51", parse_sacct(text))
    assert st is not None and st.restarts == 1 and st.state == "FAILED" and st.name == "rq | with a pipe"
    assert [(c.job_id, c.state) for c in st.components] == [("51+0", "RUNNING"), ("51+1", "FAILED")]
    info = HetSlurmInfoWatcher().read_info("JobID|State|NodeList\n7+0|COMPLETED|n1\n7+0.batch|COMPLETED|n1\n"
                                           "7+1|CANCELLED by 0|n[2-3]\n")
    assert info["7"]["State"] == "CANCELLED"


def test_job_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.launch import jobs

    monkeypatch.setenv("HPCRL_JOB_REGISTRY", str(tmp_path / "sub" / "jobs.jsonl"))
    jobs.register_job("5", str(tmp_path / "old"))
    jobs.register_job("5+1", str(tmp_path / "new run"))  # the latest entry for a job id wins
    threads = [threading.Thread(target=jobs.register_job, args=(str(100 + i), f"/runs/{i}" + "x" * 3000))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert jobs.lookup_run_dir("5") == str(tmp_path / "new run") == jobs.lookup_run_dir("5+0")
    assert jobs.lookup_run_dir("6") is None and jobs.lookup_run_dir("--all") is None
    lines = (tmp_path / "sub" / "jobs.jsonl").read_text().splitlines()
    assert len(lines) == 18 and all(json.loads(line) for line in lines)  # nothing interleaved
    recent = [e["job_id"] for e in jobs.recent_jobs(2)]
    assert len(recent) == 2 and set(recent) <= {str(100 + i) for i in range(16)}
    monkeypatch.setenv("HPCRL_JOB_REGISTRY", "/proc/no/such/dir/jobs.jsonl")
    jobs.register_job("7", "/x")  # best effort: warns, never raises


def test_allocation_decides_the_worker_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """slurm_entry's config handling against a hetjob's environment (values as Slurm sets them)."""
    from hpcrl.config import ConfigError
    from hpcrl.launch.allocation import AllocationError, resolve_config_args

    env = {"SLURM_HET_SIZE": "2", "SLURM_JOB_NUM_NODES_HET_GROUP_1": "2", "SLURM_NTASKS_HET_GROUP_1": "4",
           "SLURM_NTASKS_HET_GROUP_0": "1"}
    args, cfg = resolve_config_args("configs/grpo_tiny.yaml", ["trainer.experiment=e x"], env, cwd=str(REPO))
    assert (cfg.trainer.nnodes, cfg.trainer.workers_per_node) == (2, 2)
    # what Slurm granted and the DP it gives, in the job's log
    assert "[hpcrl slurm] granted 2 worker node(s) x 2 task(s): actor TP=2 PP=1 DP=2" in capsys.readouterr().err
    # a group given as a node range (--nodes=1-3) has no task count, only its tasks per node (Slurm 22.05)
    ranged = {k: v for k, v in env.items() if k != "SLURM_NTASKS_HET_GROUP_1"}
    _, by_range = resolve_config_args("configs/grpo_tiny.yaml", [],
                                      {**ranged, "SLURM_TASKS_PER_NODE_HET_GROUP_1": "2(x2)"})
    assert (by_range.trainer.nnodes, by_range.trainer.workers_per_node) == (2, 2)
    assert cfg.trainer.run_dir == str(REPO / "runs" / "hpcrl" / "e x")  # relative -> pinned to the submit dir
    assert args[:2] == ["configs/grpo_tiny.yaml", "trainer.experiment=e x"]
    with pytest.raises(ConfigError, match="trainer.nnodes=3"):
        resolve_config_args("configs/grpo_tiny.yaml", ["trainer.nnodes=3"], env)
    with pytest.raises(AllocationError, match="two-component"):
        resolve_config_args("configs/grpo_tiny.yaml", [], {"SLURM_HET_SIZE": "1"})
    with pytest.raises(AllocationError, match="same number"):
        resolve_config_args("configs/grpo_tiny.yaml", [], {**env, "SLURM_NTASKS_HET_GROUP_1": "3"})
    # a third group: the rollout nodes of the split placement, counted in trainer.nnodes, their ranks last
    three = {**env, "SLURM_HET_SIZE": "3", "SLURM_JOB_NUM_NODES_HET_GROUP_2": "1", "SLURM_NTASKS_HET_GROUP_2": "2"}
    _, cfg = resolve_config_args("configs/grpo_tiny.yaml", ["actor.parallel.tensor_parallel=2"], three, cwd=str(REPO))
    assert (cfg.trainer.nnodes, cfg.trainer.workers_per_node) == (3, 2)
    assert (cfg.trainer.placement, cfg.trainer.rollout_workers) == ("split", 2)
    with pytest.raises(ConfigError, match="trainer.placement=colocated: the allocation has 2 trainer node"):
        resolve_config_args("configs/grpo_tiny.yaml", ["trainer.placement=colocated"], three)
    with pytest.raises(AllocationError, match="same number of workers per node"):
        resolve_config_args("configs/grpo_tiny.yaml", [], {**three, "SLURM_NTASKS_HET_GROUP_2": "4"})


def test_failed_runs_are_not_requeued_when_a_restart_cannot_help(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after scancel/preemption/time limit, a deliberate stop, or the limit reached: no requeue
    (the requeue itself is tested on the cluster: tests/test_resume.py, the killed-ranks test)."""
    from hpcrl.config import load_config
    from hpcrl.launch.allocation import requeue_after_failure, write_verdict

    cfg = load_config("configs/grpo_tiny.yaml", [f"trainer.run_dir={tmp_path}", "slurm.max_failure_requeues=2"])
    env = {"SLURM_JOB_ID": "424242", "SLURM_RESTART_COUNT": "1"}
    (tmp_path / "slurm").mkdir()
    job_json = tmp_path / "slurm" / "job.json"
    job_json.write_text(json.dumps({"job_id": "424242", "failure_requeues": 2}))
    assert not requeue_after_failure(cfg, env, 137, [])  # the limit: 2 of 2 done
    job_json.write_text(json.dumps({"job_id": "424242", "failure_requeues": 0}))
    import signal

    assert not requeue_after_failure(cfg, env, 143, [signal.SIGTERM])  # cancelled or preempted
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    write_verdict(str(tmp_path), 3)  # what the trainer records when it stops on NaN/Inf steps
    assert not requeue_after_failure(cfg, env, 3, [])
    assert json.loads(job_json.read_text())["failure_requeues"] == 0  # nothing counted, nothing requeued
    assert not requeue_after_failure(load_config("configs/grpo_tiny.yaml", [f"trainer.run_dir={tmp_path}",
                                                                            "slurm.requeue=false"]), env, 137, [])


def test_a_restart_records_its_outcome_after_an_instance_killed_while_submitit_wrote_its_own(tmp_path: Path) -> None:
    """A requeue can kill the batch process while submitit writes the job's result (`*_result.pkl.save_tmp`,
    then renamed); submitit refuses to write a result while that file exists (submitit issue #1617), so the
    restarted job failed at its very end: CI, 2026-12-07, a preempted run's last restart trained to "done:
    10 steps" and the job ended FAILED. Here submitit's own job runner (`python -m submitit.core._submit`, as
    the batch script runs it) runs hpcrl's submitted function as a restart beside such a file; outside a
    hetjob it fails at once, and that outcome must be recorded. The control: a plain function's outcome is
    lost beside the same file."""
    import submitit
    from submitit.core.utils import JobPaths

    from hpcrl.launch.allocation import submitit_entry

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update(SUBMITIT_EXECUTOR="slurm", SLURM_RESTART_COUNT="1", PYTHONPATH=str(REPO))

    def run_as_restart(job_id: str, fn, *args) -> tuple[JobPaths, subprocess.CompletedProcess]:
        paths = JobPaths(tmp_path, job_id=job_id)
        submitit.helpers.DelayedSubmission(fn, *args).dump(paths.submitted_pickle)
        paths.result_pickle.with_suffix(".pkl.save_tmp").write_bytes(b"")  # what the killed instance left
        r = subprocess.run([sys.executable, "-m", "submitit.core._submit", str(tmp_path)], capture_output=True,
                           text=True, timeout=120, env={**env, "SLURM_JOB_ID": job_id}, cwd=REPO)
        return paths, r

    paths, r = run_as_restart("4242", os.path.getsize, str(tmp_path / "absent"))
    assert r.returncode != 0 and "A temporary saved file already exists" in r.stderr, r.stderr[-3000:]
    assert not paths.result_pickle.exists()  # the control: submitit lost the outcome

    paths, r = run_as_restart("4243", submitit_entry, "hpcrl.trainer.main:main", ["configs/grpo_tiny.yaml"])
    assert r.returncode != 0 and "A temporary saved file already exists" not in r.stderr, r.stderr[-3000:]
    assert f"[hpcrl slurm] removed {paths.result_pickle}.save_tmp" in r.stderr, r.stderr[-3000:]
    outcome, trace = submitit.core.utils.pickle_load(paths.result_pickle)
    assert outcome == "error" and "not inside a two-component heterogeneous job" in trace, trace
    assert not paths.result_pickle.with_suffix(".pkl.save_tmp").exists()


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_requeue_of_a_job_slurm_is_already_requeuing_is_counted_and_logged(tmp_path: Path,
                                                                           capfd: pytest.CaptureFixture) -> None:
    """A second requeue of the same job (the launcher's after a failed srun, while Slurm is already taking
    the job back: the requeue's own SIGTERM can kill `scontrol requeue` after it succeeded, status -15 and
    no message) is success, named in the log as a requeue, and counted. Before, it was
    `scontrol requeue N failed:` plus a traceback, and the user's log missed one requeue of three."""
    from hpcrl.config import load_config
    from hpcrl.launch.allocation import requeue_after_failure
    from hpcrl.launch.slurm_query import requeue_job, scontrol_job

    r = run(["sbatch", "--parsable", "--requeue", "--partition=normal", f"--output={tmp_path}/job.out",
             "--wrap", "sleep 300"], timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        _wait_for(lambda: (scontrol_job(job) or {}).get("JobState") == "RUNNING", "the job to run", 120)
        assert requeue_job(job, restart=0).how == "requeued"  # the first requeue: scontrol says nothing
        second = run(["scontrol", "requeue", job], timeout=60)
        assert second.returncode != 0, "Slurm accepted a second requeue: this test no longer sees the race"
        cfg = load_config("configs/grpo_tiny.yaml", [f"trainer.run_dir={tmp_path}", "slurm.max_failure_requeues=2"])
        (tmp_path / "slurm").mkdir()
        capfd.readouterr()
        assert requeue_after_failure(cfg, {"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": "0"}, 137, [])
        err = capfd.readouterr().err
        assert "requeued (failure requeue 1 of 2, already requeued (JobState=" in err, err
        assert "Restarts=1" in err and "scontrol requeue" not in err and "Traceback" not in err, err
        assert json.loads((tmp_path / "slurm" / "job.json").read_text())["failure_requeues"] == 1
        # a job that is not being requeued (this run is restart 1 of it now) is still a failure, with the reason
        refused = requeue_job(job, restart=1)
        assert not refused.requeued and "Restarts=1" in refused.how, refused
    finally:
        run(["scancel", job], timeout=60)
