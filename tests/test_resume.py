"""Preemption and resume: interrupted runs end with the same weights, byte for byte, as an uninterrupted one.

The reference is the session's uninterrupted GRPO run (conftest.grpo_reference: 10 steps, 2 workers,
TP=1 x DP=2, checkpoints every 4 steps). On the local Slurm cluster the same run (1 controller node + 2
nodes x 1 worker: the same 2-worker layout, its DP group across nodes) is
  - sent SIGUSR1 after step 1 (what `--signal=B:USR1@N` does before the time limit): the controller
    saves at the next step boundary, requeues the job itself, and the restarted job resumes; then,
    in the same job, preempted by a job on a higher-priority partition (PreemptMode=REQUEUE: TERM,
    grace, requeue), and resumed again;
  - killed: a worker SIGKILLed in the update, then another in the rollout, then the controller: each
    time the job fails (the loss named with rank and host within the heartbeat bound), requeues itself
    and resumes from the last checkpoint.
All must finish with the reference's final weights and optimizer state and the same per-step metrics.
(A run whose whole MPI world is SIGKILLed in a save: tests/test_dpo.py, the same checkpoint store.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    FULLY_ASYNC,
    HPCRL,
    REPO,
    SPANNING_SEGMENTS,
    SPLIT_OVERRIDES,
    TRAIN_OVERRIDES,
    TRAIN_STEPS,
    hpcrl_cli,
    hpcrl_run,
    read_jsonl,
    run,
)

SLURM_OVERRIDES = [*TRAIN_OVERRIDES, "algorithm.adv_estimator=grpo", "checkpoint.save_every=4",
                   "trainer.workers_per_node=1", "actor.parallel.tensor_parallel=1"]  # REFERENCE_LAYOUT on 2 nodes
# Wall-clock numbers (and the timelines) and the processes' peak memory differ between runs; everything else in a step
# record must be identical.
TIMING = ("time/", "throughput/", "memory/", "trace/")


def submit(run_dir: Path, partition: str, *extra: str, env: dict[str, str] | None = None, nodes: int = 2) -> str:
    r = run([HPCRL, "submit", "--nodes", str(nodes), "--partition", partition, "--json", "configs/grpo_tiny.yaml",
             f"trainer.run_dir={run_dir}", *SLURM_OVERRIDES, *extra], timeout=120, env=env)
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
    """`hpcrl status JOB --json`: state, restarts and the het components' states (ID+0, ID+1). In this
    process (conftest.hpcrl_cli): the waits below ask every 2 s, and an interpreter a call cost ~0.2 s of
    CPU, a tenth of a core through every wait of the Slurm tests, taken from the jobs they wait for."""
    r = hpcrl_cli("status", job, "--json")
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}


def poke_if_pending(job: str, partition: str, st: dict | None = None) -> dict:
    """This local cluster leaves a requeued hetjob pending for ~76 s until the partition is touched
    (docs/slurm.md); a real scheduler's next cycle starts it. Touching it changes nothing else."""
    st = job_status(job) if st is None else st
    if st.get("state") == "PENDING":
        subprocess.run(["scontrol", "update", f"PartitionName={partition}", "State=UP"], capture_output=True)
    return st


def finished(job: str, partition: str) -> bool:
    st = poke_if_pending(job, partition)
    comps = st.get("components") or []
    return len(comps) == 2 and all(c["state"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED",
                                                      "PREEMPTED") for c in comps)


def check_completed_after_restart(job: str, run_dir: Path) -> None:
    st = job_status(job)
    assert [c["state"] for c in st["components"]] == ["COMPLETED", "COMPLETED"], launcher_report(st, run_dir)
    assert st["restarts"] >= 1, st  # it really went through a requeue


def launcher_report(st: dict, run_dir: Path) -> str:
    """The job's state and what the launcher and submitit said in its stderr (a job that ended FAILED
    after its run had finished, CI 2026-12-07, showed only the state's first fields)."""
    try:
        err = Path(json.loads((run_dir / "slurm" / "job.json").read_text())["stderr"]).read_text(errors="replace")
    except (OSError, ValueError, KeyError) as e:
        err = f"(no job stderr: {e})"
    said = [line for line in err.splitlines() if line.startswith(("[hpcrl", "submitit", "slurmstepd", "srun"))
            or "Error" in line]
    return f"{json.dumps(st)}\n" + "\n".join(said[-60:])


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
def test_usr1_then_preemption_requeue_and_resume_bit_exact(slurm_cluster: None,
                                                           grpo_reference: tuple[Path, list[dict]],
                                                           tmp_path: Path) -> None:
    """One job on the preemptible partition meets both interruptions in turn, as a long run on a
    preemptible queue does: SIGUSR1 after step 1, then, once the restarted job has resumed, a job on
    a higher-priority partition that preempts it. One job instead of two saves a start-up and a run.
    The resumed run's remaining steps took a few seconds (~0.5 s each): the preempting job is submitted as
    the resume is logged (polled every 50 ms; polled every 2 s behind `hpcrl status`, it once came after
    the run's last step), and the first restart's rewards come 0.5 s a sample later (the same rewards, ~8 s
    a step: tests/reward_fns.py says why)."""
    run_dir = tmp_path / "usr1-preempted"
    log_file = run_dir / "logs" / "controller.log"
    job = submit(run_dir, "preempt", "reward.function=reward_fns:digit_fraction_slower_after_a_restart",
                 env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    high = None

    def restarted() -> bool:  # the requeued job's world is up
        poke_if_pending(job, "preempt")
        return len(job_ranks(run_dir, restart=1)) == 3

    try:
        wait_for(lambda: steps_done(run_dir) >= 1, 600, "step 1", job)
        r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        wait_for(restarted, 600, "the requeued job's ranks", job)
        deadline = time.monotonic() + 300
        while "resumed from" not in log_file.read_text(errors="replace"):
            assert time.monotonic() < deadline, "no resume within 300 s of the restart: " + log_file.read_text()[-3000:]
            time.sleep(0.05)
        # all 4 nodes, exclusively, on the high-priority partition: Slurm must preempt the run to start it
        r = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", "4", "--exclusive", "--mem=100M", "-t", "2",
                            "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 2"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        high = r.stdout.strip().split(";")[0]
        wait_for(lambda: finished(job, "preempt"), 900, "the preempted job to finish", job)
    finally:
        subprocess.run(["scancel", job] + ([high] if high else []), capture_output=True)
    check_completed_after_restart(job, run_dir)
    assert job_status(job)["restarts"] >= 2  # the self-requeue after USR1, then the preemption's
    log = controller_log(run_dir)
    assert "signal SIGUSR1; checkpoint saved" in log and "requeued" in log, log[-3000:]
    assert log.count("resumed from") >= 2, log[-3000:]
    check_same_as_reference(run_dir, grpo_reference)


def failure_report(err: str, rank: int) -> str:
    """What hpcrl itself said in a job's stderr about failures and `rank` (without the libraries'
    warnings, which fill the file and push these lines out of CI's excerpt)."""
    keys = ("[hpcrl", "failed", " lost", "no reply", "consequences", f"rank {rank} ")
    return "\n".join(line for line in err.splitlines() if any(k in line for k in keys))[-6000:]


def job_ranks(run_dir: Path, restart: int) -> dict[int, int]:
    """MPI rank -> pid of the run's hpcrl_entry processes in the job's Slurm restart `restart` (all
    nodes of the local cluster are this machine)."""
    found: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            # A rank is `python launchers/hpcrl_entry.py ...`; srun's own argv holds that path too, and with
            # SLURM_PROCID=0 from the batch step srun would pass for rank 0 whenever its pid is the higher
            # one (after the pid counter wraps: CI saw srun at 32750 and the ranks at 322-326).
            if len(argv) < 2 or not argv[1].endswith(b"hpcrl_entry.py"):
                continue
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
            parent = (Path("/proc") / (d / "stat").read_text().rsplit(")", 1)[1].split()[1] / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if (env.get(b"HPCRL_RUN_DIR") == str(run_dir).encode() and b"hpcrl_entry.py" not in parent
                and env.get(b"SLURM_RESTART_COUNT", b"0") == str(restart).encode()):
            found[int(env[b"SLURM_PROCID"])] = int(d.name)  # a forked child of a rank is not a rank
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slurm
def test_killed_worker_and_controller_requeue_and_resume_bit_exact(slurm_cluster: None,
                                                                    grpo_reference: tuple[Path, list[dict]],
                                                                    tmp_path: Path) -> None:
    """kill -9 of rank 2 in its 6th update (step 6), of rank 1 in the 5th rollout after the restart
    (step 9), then of the controller as it sends step 9's update after the second restart: three
    failures, three requeues, the reference's weights."""
    run_dir = tmp_path / "killed"
    bound = 10.0
    # hpcrl/launch/faults.py: RESTART:RANK:METHOD:N; the environment reaches every rank through sbatch.
    # The controller kills itself too, at a known point: killed from outside once step 9 had begun, it
    # could have finished the run already (a step of the tiny model takes under a second).
    env = {**os.environ, "HPCRL_FAULT": "0:2:update_actor:6,1:1:generate_shard:5,2:0:update_actor:1",
           "HPCRL_HEARTBEAT_TIMEOUT": str(bound)}
    job = submit(run_dir, "normal", "slurm.max_failure_requeues=3", env=env)

    def second_restart_ranks() -> dict[int, int]:  # the world that resumes from step 8 after the rollout kill
        poke_if_pending(job, "normal")
        return job_ranks(run_dir, restart=2)

    try:
        wait_for(lambda: len(second_restart_ranks()) == 3, 900, "the second restart's ranks", job)
        ranks = job_ranks(run_dir, restart=2)
        assert sorted(ranks) == [0, 1, 2], ranks
        err_file = Path(json.loads((run_dir / "slurm" / "job.json").read_text())["stderr"])
        wait_for(lambda: not alive(ranks[0]), 600, "the controller to kill itself in step 9", job)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in ranks.values()):
            assert time.monotonic() < deadline, "the killed controller's workers did not exit within 60 s"
            time.sleep(0.1)
        workers_gone_at = time.time()
        killed = re.search(r"\[hpcrl fault\] rank 0 pid (\d+): SIGKILL at .*unix time ([\d.]+)",
                           err_file.read_text(errors="replace"))
        assert killed and int(killed.group(1)) == ranks[0], err_file.read_text(errors="replace")[-3000:]
        workers_gone_s = workers_gone_at - float(killed.group(2))
        wait_for(lambda: finished(job, "normal"), 900, "the job to finish", job)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    check_completed_after_restart(job, run_dir)
    assert job_status(job)["restarts"] == 3
    assert workers_gone_s < bound + 10, f"workers took {workers_gone_s:.1f} s to exit after the controller died"
    text = controller_log(run_dir)
    info = json.loads((run_dir / "slurm" / "job.json").read_text())
    err = Path(info["stderr"]).read_text(errors="replace")
    assert [f["restart"] for f in info["failures"]] == [0, 1, 2] and info["failure_requeues"] == 3, info
    # each worker death is named by the controller with its host and pid, and ends the job within the bound
    for rank, failure in zip((2, 1), info["failures"], strict=False):
        killed = re.search(rf"\[hpcrl fault\] rank {rank} pid (\d+): SIGKILL at .*unix time ([\d.]+)", err)
        assert killed, err[-3000:]
        assert re.search(rf"rank {rank} \(host \S+, slurm node n\d, pid {killed.group(1)}\)[^\n]* lost", err), \
            failure_report(err, rank)
        assert failure["at"] - float(killed.group(2)) < bound + 15, (failure, killed.group(0))
    assert err.count("requeued (failure requeue") == 3, err[-3000:]
    assert [int(m) for m in re.findall(r"resumed from \S+step_(\d+)", text)] == [4, 8, 8], text[-3000:]
    check_same_as_reference(run_dir, grpo_reference)


def hf_weights(run_dir: Path, step: int, out: Path) -> dict:
    """The actor of a run's checkpoint `step` as HF tensors (`hpcrl ckpt export-hf`: any layout)."""
    from safetensors.torch import load_file

    r = hpcrl_cli("ckpt", "export-hf", str(run_dir), "--step", str(step), "--out", str(out))
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def resumable_copy(ref_dir: Path, to: Path, step: int) -> Path:
    """A copy of the reference run as it stood after `step`'s checkpoint (later ones removed)."""
    import shutil

    shutil.copytree(ref_dir, to)
    for p in (to / "checkpoints").iterdir():
        if p.name.startswith("step_") and int(p.name[5:]) > step:
            shutil.rmtree(p)
    (to / "checkpoints" / "latest").write_text(f"step_{step:08d}\n")
    return to


def test_resumed_on_other_allocations_trains_as_the_uninterrupted_run(grpo_reference: tuple[Path, list[dict]],
                                                                     tmp_path: Path) -> None:
    """A checkpoint resumes on whatever allocation comes next (docs/checkpoint.md). The reference's
    step-8 checkpoint (2 workers, TP=1 x DP=2, colocated; AdamW's moments cut over DP) resumed for
    steps 9-10 on 2 workers at TP=2 x DP=1, on 1 worker, and split (2 trainer workers at TP=2, DP=1,
    and 1 rollout worker; generation not ahead) for step 9, whose checkpoint resumes colocated on 2
    workers at TP=1 x DP=2 for step 10. Each trains the uninterrupted run's prompts with its sampling seeds, draws
    the same samples (rewards and lengths equal), and ends with the same weights within fp32 rounding
    (measured: 7.3e-5 of the largest change of steps 9-10 at most). Resuming with another model or another
    data seed is refused before anything starts, naming both values, and changes nothing."""
    ref_dir, ref_steps = grpo_reference
    assert (ref_dir / "checkpoints" / "step_00000008").is_dir()
    ref_weights = hf_weights(ref_dir, TRAIN_STEPS, tmp_path / "ref-hf")
    # what steps 9-10 changed: the scale of the differences below (a step skipped or repeated, or the
    # moments lost, would differ by about this much)
    start = hf_weights(resumable_copy(ref_dir, tmp_path / "at8", 8), 8, tmp_path / "at8-hf")
    update = max(float((ref_weights[k] - start[k]).abs().max()) for k in start)
    assert update > 1e-3

    def resume(name: str, *layout: str, steps: int = TRAIN_STEPS, src: Path | None = None) -> Path:
        d = tmp_path / name if src else resumable_copy(ref_dir, tmp_path / name, 8)
        if src:
            import shutil

            shutil.copytree(src, d)
        hpcrl_run(d, *layout, f"trainer.total_steps={steps}", "checkpoint.save_every=1")
        assert "resumed from" in controller_log(d)
        return d

    tp2 = resume("tp2-dp1", "trainer.workers_per_node=2")  # (TRAIN_OVERRIDES: TP=2)
    one = resume("one-worker", "trainer.workers_per_node=1", "actor.parallel.tensor_parallel=1")
    split = resume("split", "trainer.workers_per_node=3", "trainer.placement=split", "trainer.rollout_workers=1",
                   "rollout.max_staleness=0", steps=9)
    assert "split" in controller_log(split)
    back = resume("split-then-colocated", "trainer.workers_per_node=2", "actor.parallel.tensor_parallel=1",
                  src=split)
    worst = {}
    for d in (tp2, one, back):
        steps = read_jsonl(d / "metrics.jsonl")
        assert [m["step"] for m in steps] == list(range(1, TRAIN_STEPS + 1)), d
        for mine, ref in zip(steps[8:], ref_steps[8:], strict=True):
            for k in ("data/prompt_rows", "data/sampling_seeds", "reward/mean", "response_length/mean",
                      "response_length/max"):
                assert mine[k] == ref[k], (d.name, mine["step"], k, mine[k], ref[k])
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
                assert mine[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), (d.name, mine["step"], k)
        got = hf_weights(d, TRAIN_STEPS, tmp_path / f"{d.name}-hf")
        assert sorted(got) == sorted(ref_weights)
        worst[d.name] = max(float((got[k] - ref_weights[k]).abs().max()) for k in got) / update
    print("weights after step 10, largest difference relative to the largest change of steps 9-10:", worst)
    # measured 3.5e-5 .. 7.3e-5 (6.7e-5 .. 1.0e-4 when the reference was TP=2 x DP=2 on 4 workers; the largest
    # on the key biases, whose gradient is rounding noise that Adam scales up)
    assert max(worst.values()) < 1e-3, worst
    # the control: another model or data seed on the same run directory, refused before anything starts
    d = resumable_copy(ref_dir, tmp_path / "refused", 8)
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    r = run([HPCRL, "run", "configs/grpo_tiny.yaml", f"trainer.run_dir={d}", *TRAIN_OVERRIDES,
             "model.path=models/tiny-qwen3", "data.seed=7"], timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "checkpoint.resume:" in r.stderr and "data.seed: 1 in the checkpoint, 7 now" in r.stderr, r.stderr
    assert "'models/tiny-qwen3' is another model than the checkpoint's 'models/tiny-qwen2'" in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before


def processes() -> dict[int, bytes]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = (d / "cmdline").read_bytes()
            except OSError:
                pass
    return out


def test_one_step_off_run_stopped_and_resumed_trains_on_the_same_batches(one_step_off: tuple[Path, list[dict]],
                                                                         tmp_path: Path) -> None:
    """The split placement's one-step-off run stopped after step 8 and resumed at the same layout: its
    checkpoint holds the batch generated for the next step, so the resumed run trains on exactly the batches
    of the uninterrupted run. Each prompt is seen once, none skipped or repeated, and the weights at the end
    are the same byte for byte. The stop is a copy of the fixture's step-8 checkpoint: a stop's save (SIGTERM,
    what scancel or a preemption sends: the controller saves at the next step boundary and exits 0) is the
    same save at a step boundary, and a run of its own, stopped after step 3, cost a world and 7 steps more
    (SIGTERM stops: tests/test_pools.py's fully_async split run, tests/test_dpo.py, the Slurm tests)."""
    ref_dir, ref_steps = one_step_off
    stopped = 8
    run_dir = resumable_copy(ref_dir, tmp_path / "run", stopped)
    latest = run_dir / "checkpoints" / f"step_{stopped:08d}"
    assert (latest / "rollouts_ahead.pt").is_file()  # the batch of step stopped + 1, generated before the stop
    steps = hpcrl_run(run_dir, *SPLIT_OVERRIDES)
    log = controller_log(run_dir)
    assert f"resumed with 1 batch(es) generated ahead, for step(s) [{stopped + 1}]" in log
    assert [m["step"] for m in steps] == list(range(1, TRAIN_STEPS + 1))
    assert same_records(ref_steps, steps) == []  # prompts, rewards, losses, staleness: all equal
    rows = [r for m in steps for r in m["data/prompt_rows"]]
    assert len(rows) == len(set(rows)) == 8 * TRAIN_STEPS
    assert shard_digests(ref_dir, TRAIN_STEPS) == shard_digests(run_dir, TRAIN_STEPS)


def test_one_step_off_checkpoint_resumes_colocated_on_the_same_prompts(one_step_off: tuple[Path, list[dict]],
                                                                       tmp_path: Path) -> None:
    """The reverse of the split resume above: the one-step-off run's step-8 checkpoint (split placement on
    3 workers, holding the batch generated ahead for step 9) resumed colocated on 2 workers (the trainer's
    TP=2; the queued batch crosses to another allocation), generation
    not ahead. The queued batch, a step staler than the new bound of 0, is generated again from its prompts
    with the current weights (logged), so steps 9-10 train the prompts the one-step-off run trained, each
    prompt once."""
    ref_dir, ref_steps = one_step_off
    d = resumable_copy(ref_dir, tmp_path / "colocated", 8)
    assert (d / "checkpoints" / "step_00000008" / "rollouts_ahead.pt").is_file()
    steps = hpcrl_run(d, "trainer.workers_per_node=2")
    log = controller_log(d)
    assert "resumed with 1 batch(es) generated ahead, for step(s) [9]" in log, log[-3000:]
    assert "regenerating its 8 prompts with the current weights" in log, log[-3000:]
    assert [m["step"] for m in steps] == list(range(1, TRAIN_STEPS + 1))
    assert [m["data/prompt_rows"] for m in steps] == [m["data/prompt_rows"] for m in ref_steps]
    assert [m["data/sampling_seeds"] for m in steps[8:]] == [m["data/sampling_seeds"] for m in ref_steps[8:]]
    rows = [r for m in steps for r in m["data/prompt_rows"]]
    assert len(rows) == len(set(rows)) == 8 * TRAIN_STEPS
    assert "rollout/staleness" not in steps[-1]  # step 10 was generated colocated, after step 9's update


def test_fully_async_run_stopped_mid_stream_resumes_each_prompt_once(grpo_reference: tuple[Path, list[dict]],
                                                                    fully_async_run: tuple[Path, list[dict]],
                                                                    tmp_path: Path) -> None:
    """rollout.mode=fully_async saved mid-stream: the checkpoint holds the stream (samples in flight with their
    tokens, versions and log-probs, groups waiting) beside the sampler's cursor. A copy of the fully_async
    run's step-2 checkpoint (conftest.fully_async_run: its checkpoints are saved at step boundaries, as at a
    SIGTERM's; a stopped fully_async run: tests/test_pools.py) resumed with a tighter bound
    (rollout.max_staleness 2 -> 1) drops exactly the saved groups now too stale, counts them and generates
    them again: every prompt of the run is trained once (the synchronous reference's prompts)."""
    import torch

    ref_dir, ref_steps = grpo_reference
    total, stopped = 6, 2
    run_dir = resumable_copy(fully_async_run[0], tmp_path / "run", stopped)
    base = [HPCRL, "run", "configs/grpo_tiny.yaml", f"trainer.run_dir={run_dir}", *TRAIN_OVERRIDES,
            f"trainer.total_steps={total}"]
    state = torch.load(run_dir / "checkpoints" / f"step_{stopped:08d}" / "stream.pt", weights_only=True)
    held = [g for g in state["groups"] if any(s["versions"] for s in g["samples"])]
    assert held and state["version"] == stopped  # samples were in flight or waiting at the save
    # at step stopped + 1 the trainer holds version `stopped`: bound 1 drops every group with an older token
    too_stale = [g["row"] for g in held if min(v for s in g["samples"] for v in s["versions"]) < stopped - 1]
    assert too_stale, held  # else the drop below would be checked on nothing (measured: 8 of 16 groups held)
    # another rollout mode would skip the prompts of the samples held: refused before anything starts
    other = run([*base, "trainer.placement=split", "trainer.rollout_workers=2", "rollout.mode=one_step_off"],
                timeout=300)
    assert other.returncode == 2 and "the checkpoint holds the samples of a fully_async stream" in other.stderr, \
        other.stderr[-2000:]
    # the samples' length of the fixture, in segments of 4 tokens: what the saved stream holds is per token
    steps = hpcrl_run(run_dir, *FULLY_ASYNC, *SPANNING_SEGMENTS, "rollout.segment_tokens=4",
                      f"trainer.total_steps={total}", "rollout.max_staleness=1")
    assert f"resumed with {len(state['groups'])} group(s) of the stream" in controller_log(run_dir)
    assert [m["step"] for m in steps] == list(range(1, total + 1))
    assert steps[stopped]["stream/dropped_groups"] == len(too_stale), (too_stale, steps[stopped])
    assert all(m["stream/staleness_max"] <= 1 for m in steps[stopped:])
    print(f"fully_async resume: stopped after step {stopped}, {len(held)} group(s) held, {len(too_stale)} dropped")
    rows = [r for m in steps for r in m["data/prompt_rows"]]
    assert len(rows) == len(set(rows)) == 8 * total
    # the sampler's first `total` batches (a group regenerated, or finished late, may move to a later step)
    assert sorted(rows) == sorted(r for m in ref_steps[:total] for r in m["data/prompt_rows"])


# 6 steps: the Slurm job's first run scores its samples 0.5 s later each (~8 s a step, no CPU), so the SIGUSR1 sent
# after step 1 lands mid-run; the restart trains steps 3-6 at full speed (with 4 steps of ~0.3 s the run could end
# before the signal arrived, and the job finish without the requeue the test is about; 20 such steps did it)
FSDP_STEPS = 6
FSDP_PHI3 = ["actor.engine=fsdp", "model.path=models/tiny-phi3", "actor.parallel.tensor_parallel=1",
             "algorithm.adv_estimator=grpo", f"trainer.total_steps={FSDP_STEPS}", "checkpoint.save_every=2"]


@pytest.mark.slurm
def test_fsdp_engine_trains_a_family_megatron_cannot_and_resumes_bit_exact(slurm_cluster: None, tmp_path: Path) -> None:
    """actor.engine=fsdp (hpcrl.engines.fsdp) on a tiny Phi-3, a family the Megatron converter refuses:
    GRPO with vLLM rollout on 2 workers (DP=2), the weights resharded into vLLM every step (the
    rollout-vs-actor log-prob gap stays at fp32 rounding: measured <= 9.6e-7; a stale or misnamed
    tensor after an update gives ~1e-2 and more). The same run as a Slurm job on the preemptible
    partition, sent SIGUSR1 after step 1, saves at the step boundary (torch.distributed.checkpoint),
    requeues itself and resumes at the same layout: it ends byte for byte as the uninterrupted run, with
    the same step records (a whole world killed in a save is tests/test_dpo.py's
    test_killed_then_stopped_run_resumes_bit_exact, the same checkpoint store for either engine). The
    uninterrupted run's step-4 checkpoint resumed with the split placement (1 trainer worker at DP=1,
    DCP reshards; 1 rollout worker fed over the bridge) draws the same samples and ends within fp32
    rounding of it; resumed on the Megatron engine it is refused before anything starts, naming
    actor.engine."""
    from hpcrl.config import load_config

    # the bad input first: the Megatron engine refuses the family before anything starts
    r = run([HPCRL, "config", "configs/grpo_tiny.yaml", "model.path=models/tiny-phi3",
             "actor.parallel.tensor_parallel=1"], timeout=60)
    assert r.returncode == 2 and "'Phi3ForCausalLM'" in r.stderr and "actor.engine=fsdp" in r.stderr, r.stderr
    assert load_config(REPO / "configs" / "grpo_tiny.yaml", FSDP_PHI3).actor.engine == "fsdp"

    whole_dir = tmp_path / "whole" / "run"
    whole = hpcrl_run(whole_dir, *FSDP_PHI3, "trainer.workers_per_node=2")
    assert [m["step"] for m in whole] == list(range(1, FSDP_STEPS + 1))
    for m in whole:
        assert m["rollout_actor_logprob_gap_max"] <= 1e-4, m
    before = FSDP_STEPS - 2  # the last two steps: what the resumes below must reproduce
    start = hf_weights(whole_dir, before, tmp_path / "before-hf")
    end = hf_weights(whole_dir, FSDP_STEPS, tmp_path / "whole-hf")
    update = max(float((end[k] - start[k]).abs().max()) for k in end)
    assert update > 1e-3  # the last two steps moved the weights
    assert any(".qkv_proj." in k for k in end)  # Phi-3's fused projections, under their HF names

    # the same run as a Slurm job on the preemptible partition (1 node x 2 workers: the same layout), sent
    # SIGUSR1 after step 1 (what --signal=B:USR1@N does before the time limit): the controller saves at the
    # next step boundary and requeues the job itself; the restarted job resumes from the DCP checkpoint
    usr1 = tmp_path / "usr1" / "run"
    job = submit(usr1, "preempt", *FSDP_PHI3, "trainer.workers_per_node=2",  # (not SLURM_OVERRIDES' 1)
                 "reward.function=reward_fns:digit_fraction_slower_before_a_restart", nodes=1,
                 env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    try:
        wait_for(lambda: (usr1 / "metrics.jsonl").exists(), 600, "step 1", job)
        while steps_done(usr1) < 1:  # (polled closely: the steps are short)
            time.sleep(0.05)
        r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: finished(job, "preempt"), 900, "the job to finish after its requeue", job)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    check_completed_after_restart(job, usr1)
    log = controller_log(usr1)
    assert "signal SIGUSR1; checkpoint saved" in log and "resumed from" in log, log[-3000:]
    got = hf_weights(usr1, FSDP_STEPS, tmp_path / "usr1-hf")
    assert sorted(got) == sorted(end) and all(torch.equal(got[k], end[k]) for k in end)
    steps = read_jsonl(usr1 / "metrics.jsonl")
    assert [m["step"] for m in steps] == list(range(1, FSDP_STEPS + 1)) and same_records(whole, steps) == []

    # the step-4 checkpoint resumed with the split placement: 1 trainer worker (DP=1: DCP reshards) and 1
    # rollout worker, the weights sent over the bridge after each update (hpcrl.engines.transfer), generation
    # on-policy (max_staleness=0): the engine's log-probs equal the actor's (a stale or misnamed tensor
    # would show), the steps draw the same samples, and the weights end within fp32 rounding
    one = resumable_copy(whole_dir, tmp_path / "one" / "run", before)
    split = hpcrl_run(one, *FSDP_PHI3, "trainer.workers_per_node=2", "trainer.placement=split",
                      "trainer.rollout_workers=1", "rollout.max_staleness=0")
    log = controller_log(one)
    assert "resumed from" in log and "split" in log, log[-3000:]
    assert [m["step"] for m in split] == list(range(1, FSDP_STEPS + 1))
    for mine, ref in zip(split[before:], whole[before:], strict=True):
        assert mine["rollout_actor_logprob_gap_max"] <= 1e-4, mine
        for k in ("data/prompt_rows", "data/sampling_seeds", "reward/mean", "response_length/mean"):
            assert mine[k] == ref[k], (mine["step"], k, mine[k], ref[k])
    got = hf_weights(one, FSDP_STEPS, tmp_path / "one-hf")
    worst = max(float((got[k] - end[k]).abs().max()) for k in end) / update
    print("split DP=1 resume: largest weight difference relative to the largest change of the last 2 steps:", worst)
    assert worst < 1e-3, worst
    # the control: the FSDP checkpoint resumed on the Megatron engine, refused before anything starts
    before = sorted(p.name for p in (one / "checkpoints").iterdir())
    r = run([HPCRL, "run", "configs/grpo_tiny.yaml", f"trainer.run_dir={one}", *TRAIN_OVERRIDES,
             *[o for o in FSDP_PHI3 if o not in ("actor.engine=fsdp", "model.path=models/tiny-phi3")],
             f"trainer.total_steps={FSDP_STEPS + 1}", "trainer.workers_per_node=1"], timeout=120)
    assert r.returncode == 2 and "actor.engine: 'fsdp' in the checkpoint, 'megatron' now" in r.stderr, r.stderr
    assert sorted(p.name for p in (one / "checkpoints").iterdir()) == before
