"""Inside a Slurm allocation: start one hpcrl MPI world over both het groups and stay its parent.

Runs as the batch script's process on the first node of het group 0 (`launchers/slurm_entry.py`,
which `sbatch/*.sh` exec, or the function `hpcrl submit` hands to submitit). It

1. checks that the job is a two-component hetjob (group 0: the controller, group 1: the workers), or a
   three-component one (group 2: the rollout workers of trainer.placement=split),
2. for a config-driven program: loads CONFIG + overrides, makes `trainer.nnodes` / `trainer.workers_per_node`
   (and with group 2 `trainer.placement` / `trainer.rollout_workers`) match what Slurm allocated, pins
   `trainer.run_dir` to an absolute path, validates,
3. exports `HPCRL_RUN_DIR` (what the resume logic needs besides `SLURM_RESTART_COUNT`, which Slurm sets),
   `HPCRL_LOG_DIR` and `HPCRL_TERMINAL` (each rank's output file, and quiet unless `logging.verbose`)
   and, under `--mpi=pmi2`, MPICH's netmod (`commands.SLURM_PMI2_ENV`: UCX's start-up overflows the plugin),
   records the job in the job registry and in `{run_dir}/slurm/job.json`,
4. runs `srun --mpi=pmi2 --het-group=0,1[,2] python launchers/hpcrl_entry.py TARGET ARGS...` as a child and
   forwards USR1 and TERM to it; srun relays them to every task.

Why forward: `#SBATCH --signal=B:USR1@N` (the "save and requeue now" warning) is delivered to the batch
shell only, and a batch process that does not handle USR1 dies of it. The controller (rank 0) saves at the
next step boundary, runs `scontrol requeue` and exits 0; workers ignore both signals. The wait for srun
restarts after every handled signal (PEP 475), so the launcher stays until srun is done.

5. when srun fails (a rank killed, OOM, a crash) and nobody signalled the job, requeues it, at most
   `slurm.max_failure_requeues` times per job (counted in job.json): the restarted job resumes from the
   last checkpoint. Not when the trainer stopped on purpose (the NaN/Inf stop: it records a verdict,
   `write_verdict`), nor after USR1/TERM (scancel, preemption and the time limit have their own paths).
Every command line here is an argv list: no shell ever sees a run name or a path.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from hpcrl.launch.commands import entry_argv, rank_output_env, srun_env, srun_het_command
from hpcrl.launch.slurm_query import requeue_job

TRAINER_TARGET = "hpcrl.trainer.main:main"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# Written by the trainer when it stops on purpose with a non-zero status (e.g. 3 after
# trainer.max_nonfinite_steps NaN/Inf steps): srun's exit status alone cannot tell that from a crash
# (the runtime's aborts use small codes too), and a restart would only repeat it.
VERDICT_FILE = os.path.join("slurm", "verdict.json")


class AllocationError(RuntimeError):
    """The allocation cannot run this program (wrong shape, bad config, or the program failed)."""


def override(key: str, value: Any) -> str:
    """A `KEY=VALUE` override whose value survives YAML parsing verbatim.

    Why: overrides are parsed as YAML, so a path with `: `, ` #`, brackets or a leading quote would
    change meaning; a JSON string is a YAML double-quoted scalar. (`${...}` stays OmegaConf
    interpolation, as everywhere in a config.)
    """
    return f"{key}={json.dumps(value)}"


def _group_tasks(env: Mapping[str, str], group: int) -> int:
    """Tasks of a het group. A group given as a node range (`--nodes=2-4 --ntasks-per-node=W`) has no
    SLURM_NTASKS_HET_GROUP_<g> (Slurm 22.05, measured): its tasks per node then come as
    SLURM_TASKS_PER_NODE_HET_GROUP_<g>, e.g. `2(x3)` or `2(x2),1`."""
    if f"SLURM_NTASKS_HET_GROUP_{group}" in env:
        return int(env[f"SLURM_NTASKS_HET_GROUP_{group}"])
    total = 0
    for part in env[f"SLURM_TASKS_PER_NODE_HET_GROUP_{group}"].split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE_HET_GROUP_{group}={part!r}")
        total += int(m.group(1)) * int(m.group(2) or 1)
    return total


def het_worker_shape(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(worker nodes, tasks per node, of those nodes the rollout ones) of the hetjob: group 1 the workers,
    or with a third group (the split placement) group 1 the trainer nodes and group 2 the rollout nodes;
    refuses any other shape."""
    size = env.get("SLURM_HET_SIZE")
    if size not in ("2", "3"):
        raise AllocationError(
            f"not inside a two-component heterogeneous job (SLURM_HET_SIZE={env.get('SLURM_HET_SIZE', 'unset')}): "
            "hpcrl needs het group 0 = the controller (1 task) and het group 1 = the workers (and, for "
            "trainer.placement=split, het group 2 = the rollout workers). Submit with `hpcrl submit`, or use an "
            "sbatch script with `#SBATCH hetjob` lines (see sbatch/grpo_tiny.sh, sbatch/grpo_split.sh).")
    if env.get("SLURM_NTASKS_HET_GROUP_0", "1") != "1":
        raise AllocationError(f"het group 0 must have exactly one task (the controller), it has "
                              f"{env.get('SLURM_NTASKS_HET_GROUP_0')}")
    shapes = []
    for group in range(1, int(size)):
        try:
            nodes = int(env[f"SLURM_JOB_NUM_NODES_HET_GROUP_{group}"])
            tasks = _group_tasks(env, group)
        except (KeyError, ValueError) as e:
            raise AllocationError(f"cannot read het group {group}'s size from the environment: {e}") from None
        if nodes <= 0 or tasks % nodes:
            raise AllocationError(f"het group {group} has {tasks} task(s) on {nodes} node(s): hpcrl needs the same "
                                  "number of workers on every node (use --ntasks-per-node)")
        shapes.append((nodes, tasks // nodes))
    if len(shapes) == 2 and shapes[0][1] != shapes[1][1]:
        raise AllocationError(f"het group 1 has {shapes[0][1]} task(s) per node and het group 2 {shapes[1][1]}: the "
                              "trainer and rollout nodes need the same number of workers per node")
    return sum(n for n, _ in shapes), shapes[0][1], shapes[1][0] if len(shapes) == 2 else 0


def resolve_config_args(config: str, overrides: Sequence[str], env: Mapping[str, str],
                        cwd: str | None = None, check_paths: bool = True) -> tuple[list[str], Any]:
    """Final `[CONFIG, *overrides]` for the program and the validated config they load to.

    The allocation is the truth: when the config's `trainer.nnodes` / `trainer.workers_per_node` differ from
    het group 1, the allocation's values are appended as overrides (with a note); when the user set them
    explicitly on the command line to something else, that is an error naming the key (exit 2).
    A relative `trainer.run_dir` is resolved against `cwd` (the submit directory) and pinned.
    """
    from hpcrl.config import ConfigError, load_config, parse_overrides
    from hpcrl.trainer.preflight import preflight

    nodes, per_node, rollout_nodes = het_worker_shape(env)
    explicit = {key for key, _, _ in parse_overrides(overrides)}
    cfg = load_config(config, overrides)
    extra: list[str] = []
    problems = []
    wanted = [("trainer.nnodes", cfg.trainer.nnodes, nodes),
              ("trainer.workers_per_node", cfg.trainer.workers_per_node, per_node)]
    if rollout_nodes:  # a third het group: the rollout nodes of the split placement
        wanted += [("trainer.placement", cfg.trainer.placement, "split"),
                   ("trainer.rollout_workers", cfg.trainer.rollout_workers, rollout_nodes * per_node)]
    where = (f"the allocation's worker group (het group 1) has {nodes} node(s) x {per_node} task(s)"
             if not rollout_nodes else
             f"the allocation has {nodes - rollout_nodes} trainer node(s) (het group 1) and {rollout_nodes} "
             f"rollout node(s) (het group 2) of {per_node} task(s) each")
    for key, have, want in wanted:
        if have == want:
            continue
        if key in explicit:
            problems.append(f"{key}={have}: {where}, so {key} must be {want}. Change the override or the sbatch "
                            "options (e.g. `sbatch ... : --nodes=N --ntasks-per-node=W SCRIPT`).")
        else:
            print(f"[hpcrl slurm] {key}={have} in the config; the allocation has {want}: using {key}={want}",
                  file=sys.stderr, flush=True)
            extra.append(f"{key}={want}")
    if problems:
        raise ConfigError(problems)
    run_dir = str(cfg.trainer.run_dir)
    if not os.path.isabs(run_dir):
        extra.append(override("trainer.run_dir", os.path.abspath(os.path.join(cwd or os.getcwd(), run_dir))))
    final = [*overrides, *extra]
    cfg = load_config(config, final)
    preflight(cfg, check_paths=check_paths)
    from hpcrl.config.derived import role_layouts

    # what Slurm granted and the DP it gives (with `--nodes MIN-MAX` the count is Slurm's choice)
    layouts = ", ".join(f"{role} {layout}" for role, layout in role_layouts(cfg).items())
    print(f"[hpcrl slurm] granted {nodes} worker node(s) x {per_node} task(s): {layouts}", file=sys.stderr,
          flush=True)
    return [config, *final], cfg


def _scontrol_paths(job_id: str) -> dict[str, str]:
    """StdOut/StdErr of the job as Slurm resolved them (for job.json and `hpcrl status`); best effort."""
    try:
        r = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    first = r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    out = {}
    for key in ("StdOut", "StdErr"):
        # values may contain spaces; each is followed by the next ` Key=` field or the end of the line
        m = re.search(rf"\b{key}=(.*?)(?= [A-Za-z]+=|$)", first)
        if m:
            out[key.lower()] = m.group(1)
    return out


def write_json_atomic(path: str, data: Mapping[str, Any]) -> None:
    """Write-then-rename, so a reader (`hpcrl status`) never sees half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def record_job(run_dir: str, env: Mapping[str, str], argv: Sequence[str]) -> None:
    """Registry line + `{run_dir}/slurm/job.json`, so `hpcrl status JOB` also finds plain sbatch runs."""
    from hpcrl.launch.jobs import register_job

    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id:
        return
    register_job(job_id, run_dir)
    folder = os.path.join(run_dir, "slurm")
    os.makedirs(folder, exist_ok=True)
    info: dict[str, Any] = {}
    try:
        with open(os.path.join(folder, "job.json"), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        info = {}
    if str(info.get("job_id")) != job_id:  # a new job for this run dir: keep nothing of the old one's
        info = {"job_id": job_id, "run_dir": run_dir}
        info.update(_scontrol_paths(job_id))
    info.update({"restart_count": int(env.get("SLURM_RESTART_COUNT", "0") or 0), "started_at": time.time(),
                 "submit_dir": env.get("SLURM_SUBMIT_DIR", ""), "argv": list(argv),
                 "controller_node": env.get("SLURMD_NODENAME", ""),
                 "worker_nodes": env.get("SLURM_JOB_NODELIST_HET_GROUP_1", "")})
    try:
        write_json_atomic(os.path.join(folder, "job.json"), info)
    except OSError as e:
        print(f"[hpcrl slurm] warning: cannot write {folder}/job.json: {e}", file=sys.stderr, flush=True)


def write_verdict(run_dir: str, status: int) -> None:
    """Record that this run (this job, this restart) stopped on purpose with `status`; Slurm only."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    os.makedirs(os.path.join(run_dir, "slurm"), exist_ok=True)
    write_json_atomic(os.path.join(run_dir, VERDICT_FILE),
                      {"job_id": job, "restart": os.environ.get("SLURM_RESTART_COUNT", "0"), "status": status,
                       "at": time.time()})


def _verdict(run_dir: str, env: Mapping[str, str]) -> int | None:
    """The status the trainer recorded in this job and restart, if it stopped on purpose."""
    try:
        with open(os.path.join(run_dir, VERDICT_FILE), encoding="utf-8") as f:
            v = json.load(f)
    except (OSError, ValueError):
        return None
    same = (str(v.get("job_id")) == env.get("SLURM_JOB_ID")
            and str(v.get("restart")) == env.get("SLURM_RESTART_COUNT", "0"))
    return int(v["status"]) if same else None


def run_srun(argv: Sequence[str], env: Mapping[str, str], received: list[int] | None = None) -> int:
    """Run srun as a child, forward USR1/TERM to it, wait until it exits; its exit status (128+N if killed).

    The signals forwarded are appended to `received`."""
    proc = subprocess.Popen(list(argv), env=dict(env))

    def forward(signum: int, frame: FrameType | None) -> None:
        if received is not None:
            received.append(signum)
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass
        print(f"[hpcrl slurm] got {signal.Signals(signum).name} at {time.strftime('%H:%M:%S')}: forwarded to srun "
              f"(pid {proc.pid})", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        rc = proc.wait()  # retried after each handled signal (PEP 475): we wait until srun is done
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc


def remove_stale_segments_on_every_node(env: Mapping[str, str], run_env: Mapping[str, str], python: str) -> None:
    """/dev/shm segments of killed jobs, removed before the world's step (why: hpcrl/launch/shm.py):
    here, on het group 0's node, and by one task per worker node in a step of its own."""
    from hpcrl.launch.shm import describe_removed, remove_stale_segments

    removed = remove_stale_segments()
    if removed:
        print(f"[hpcrl slurm] {describe_removed(removed)}", file=sys.stderr, flush=True)
    code = (f"import sys; sys.path.insert(0, {_REPO!r}); import runpy; "
            "runpy.run_module('hpcrl.launch.shm', run_name='__main__')")
    for group in range(1, int(env.get("SLURM_HET_SIZE", "2"))):  # the worker nodes (and the rollout nodes)
        nodes = env.get(f"SLURM_JOB_NUM_NODES_HET_GROUP_{group}", "")
        if not nodes.isdigit():
            return
        cmd = ["srun", f"--het-group={group}", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
               python, "-c", code]
        try:
            r = subprocess.run(cmd, env=dict(run_env), timeout=120)
            if r.returncode != 0:
                print(f"[hpcrl slurm] warning: the /dev/shm clean-up step on the nodes of het group {group} exited "
                      f"with {r.returncode}", file=sys.stderr, flush=True)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"[hpcrl slurm] warning: the /dev/shm clean-up step on the nodes of het group {group} failed: {e}",
                  file=sys.stderr, flush=True)


def launch(target: str, program_args: Sequence[str], *, config_args: bool = True,
           env: Mapping[str, str] | None = None, python: str | None = None, srun_extra: Sequence[str] = ()) -> int:
    """Everything the module docstring lists; returns srun's exit status.

    `config_args=True`: program_args are `CONFIG [KEY=VALUE ...]` (the trainer and other config-driven
    controller programs); False: passed through untouched (e.g. launchers/check_world.py OUT.json).
    """
    base_env = dict(os.environ if env is None else env)
    het_worker_shape(base_env)  # fail early and clearly outside a hetjob
    args = list(program_args)
    run_env = dict(base_env)
    cfg: Any = None
    if config_args:
        if not args:
            raise AllocationError("no CONFIG given: usage: slurm_entry.py [--target T] CONFIG [KEY=VALUE ...]")
        args, cfg = resolve_config_args(args[0], args[1:], base_env)
        run_dir = str(cfg.trainer.run_dir)
        os.makedirs(run_dir, exist_ok=True)
        run_env.update(rank_output_env(cfg))  # HPCRL_RUN_DIR, and where each rank's output goes
        run_env.setdefault("OMP_NUM_THREADS", str(cfg.slurm.cpus_per_worker))
        if cfg.slurm.mpi != "pmi2":
            srun_extra = [f"--mpi={cfg.slurm.mpi}", *srun_extra]
        record_job(run_dir, base_env, [target, *args])
    if cfg is None or cfg.slurm.mpi == "pmi2":
        run_env = srun_env(run_env)  # MPICH's netmod for Slurm's pmi2 (why: hpcrl/launch/commands.py)
    run_env.setdefault("PYTHONUNBUFFERED", "1")  # ranks' lines reach the job log as they happen
    for group in range(1, int(base_env.get("SLURM_HET_SIZE", "2"))):
        # a group allocated as a node range has no task count, and srun would then start one task for
        # the whole group ("can't run 1 processes on 2 nodes"; Slurm 22.05, measured): give it the count
        run_env.setdefault(f"SLURM_NTASKS_HET_GROUP_{group}", str(_group_tasks(base_env, group)))
    remove_stale_segments_on_every_node(base_env, run_env, python or sys.executable)
    cmd = srun_het_command(entry_argv(target, args, python=python), extra=srun_extra,
                           groups=int(base_env.get("SLURM_HET_SIZE", "2")))
    print(f"[hpcrl slurm] job {base_env.get('SLURM_JOB_ID', '?')} restart {base_env.get('SLURM_RESTART_COUNT', '0')}"
          f": {shlex.join(cmd)}", file=sys.stderr, flush=True)
    received: list[int] = []
    rc = run_srun(cmd, run_env, received)
    print(f"[hpcrl slurm] srun exited with status {rc}", file=sys.stderr, flush=True)
    if rc != 0 and config_args and requeue_after_failure(cfg, base_env, rc, received):
        return 0
    return rc


def requeue_after_failure(cfg: Any, env: Mapping[str, str], rc: int, received: Sequence[int]) -> bool:
    """Requeue a job whose srun step failed (point 5 of the module docstring); True if it was requeued.

    The count is written before `scontrol requeue`, so that a launcher killed in between can never
    requeue without counting it.
    """
    def note(msg: str) -> None:
        print(f"[hpcrl slurm] {msg}", file=sys.stderr, flush=True)

    job = env.get("SLURM_JOB_ID", "")
    limit = int(cfg.slurm.max_failure_requeues)
    if not job or not cfg.slurm.requeue or limit <= 0:
        return False
    if received:
        names = ", ".join(sorted({signal.Signals(s).name for s in received}))
        note(f"not requeued after the failure: the job was sent {names} (cancelled, preempted or at its time limit)")
        return False
    run_dir = str(cfg.trainer.run_dir)
    verdict = _verdict(run_dir, env)
    if verdict is not None:
        note(f"not requeued: the trainer stopped on purpose (status {verdict}, see its log); a restart would "
             "only repeat it")
        return False
    path = os.path.join(run_dir, "slurm", "job.json")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        info = {"job_id": job}
    done = int(info.get("failure_requeues", 0)) if str(info.get("job_id")) == job else 0
    if done >= limit:
        note(f"not requeued: job {job} was already requeued {done} time(s) after a failure "
             f"(slurm.max_failure_requeues={limit}); resubmit, or raise the limit, once the cause is fixed")
        return False
    failures = [*info.get("failures", []), {"restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                                            "srun_status": rc, "at": time.time()}]
    info.update({"job_id": job, "failure_requeues": done + 1, "failures": failures})
    try:
        write_json_atomic(path, info)
    except OSError as e:
        note(f"not requeued: cannot record the requeue in {path}: {e}")
        return False
    leader = env.get("SLURM_HET_JOB_ID") or job
    result = requeue_job(leader, int(env.get("SLURM_RESTART_COUNT", "0") or 0))
    if not result.requeued:
        note(f"scontrol requeue {leader} failed: {result.how}")
        return False
    how = "" if result.how == "requeued" else f", {result.how}"
    note(f"the run failed (srun status {rc}): job {leader} requeued (failure requeue {done + 1} of {limit}{how}); "
         "it restarts and resumes from the last checkpoint")
    return True


def clear_interrupted_result() -> str | None:
    """Remove the temporary result file a killed instance of this submitit job left; its path, or None.

    Why: submitit writes a job's outcome to `{job}_{task}_result.pkl.save_tmp`, renames it, and refuses to
    start that write if the temporary file exists (submitit issue #1617). A requeue that kills the batch
    process in between (KillWait after SIGTERM) leaves one behind, and the restarted job, having trained
    to the end, then fails on it: CI, 2026-12-07, a preempted job whose last restart logged "done: 10
    steps" ended FAILED with "A temporary saved file already exists". Nobody else writes that file: the
    restarted instance is the only process of this job that will.
    """
    if "SUBMITIT_FOLDER" not in os.environ:
        return None
    import submitit

    result = submitit.JobEnvironment().paths.result_pickle
    stale = result.with_suffix(result.suffix + ".save_tmp")
    try:
        stale.unlink()
    except FileNotFoundError:
        return None
    return str(stale)


def submitit_entry(target: str, program_args: list[str], config_args: bool = True) -> int:
    """What `hpcrl submit` pickles for submitit: launch() that raises on failure.

    Why raise: submitit records a returned value as success and the batch script then exits 0, so Slurm
    would show COMPLETED for a failed run. Raising makes submitit store the error and exit non-zero.
    """
    from hpcrl.config import ConfigError

    removed = clear_interrupted_result()
    if removed:
        print(f"[hpcrl slurm] removed {removed}: the previous instance of this job was killed while submitit "
              "wrote its result (a requeue)", file=sys.stderr, flush=True)
    try:
        rc = launch(target, program_args, config_args=config_args)
    except ConfigError as e:
        msg = "invalid config in the allocation:\n" + "\n".join(f"  - {p}" for p in e.problems)
        print(f"[hpcrl slurm] {msg}", file=sys.stderr, flush=True)
        raise AllocationError(msg) from None
    if rc != 0:
        raise AllocationError(f"srun exited with status {rc}; see the job log above for the ranks' output")
    return rc
