"""`hpcrl submit`: a heterogeneous Slurm job through submitit (group 0: the controller, group 1: the workers).

submitit has no hetjob support, so `HetSlurmExecutor` extends its Slurm executor in three places:
- the submission file gets one `#SBATCH hetjob` block per extra component after submitit's own
  `#SBATCH` lines (which describe component 0, where the batch script and so the pickled function run);
- the command is `exec`'d, so the batch shell *is* the Python process that receives `--signal=B:USR1`
  and forwards it to srun (hpcrl.launch.allocation); a bash parent would simply die of USR1;
- jobs are `HetSlurmJob`s whose sacct watcher folds the component rows `ID+0`/`ID+1` into the job's
  state (stock submitit keys them as `ID+0`, so `job.state` stayed UNKNOWN forever).

The function submitit runs is `hpcrl.launch.allocation.submitit_entry` with `use_srun=False`: it runs once,
in the batch step, and starts the one-world `srun --het-group=0,1` step itself. One job folder per run:
`{run_dir}/slurm/` holds submitit's files (`ID_submission.sh`, `ID_0_log.out/.err`, pickles), a copy of
the config as submitted and `job.json`.

Quoting: every value that reaches the submission file is written with shlex.quote (Slurm's #SBATCH parser
honours shell-style quotes; measured), `%` in paths is doubled (Slurm's filename patterns), and values
Slurm's parser cannot carry (newlines; backslashes, which it drops even inside quotes) are refused or,
for the cosmetic job name, replaced. Program arguments never pass through a shell: they are pickled.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from hpcrl.launch.allocation import TRAINER_TARGET, override, submitit_entry, write_json_atomic
from hpcrl.launch.slurm_query import combine_states, parse_slurm_time

_UNSAFE_IN_DIRECTIVE = re.compile(r"[\x00-\x1f\x7f\\]")
_COMPONENT_RE = re.compile(r"^(\d+)\+(\d+)$")


def check_directive_value(value: str, what: str) -> str:
    """Refuse what an `#SBATCH` line cannot carry: control characters (a newline ends the directive)
    and backslashes (Slurm's parser drops them even inside quotes: `'a\\b'` became `ab`, measured)."""
    if _UNSAFE_IN_DIRECTIVE.search(value):
        raise ValueError(f"{what} {value!r} cannot be written into an #SBATCH line: it contains a backslash or a "
                         "control character, which Slurm's directive parser drops or splits on. Choose another.")
    return value


def safe_job_name(name: str) -> str:
    """The job name is only a label: replace what an #SBATCH line cannot carry instead of refusing."""
    return _UNSAFE_IN_DIRECTIVE.sub("_", name)[:200] or "hpcrl"


def slurm_filename_escape(path: str) -> str:
    """A literal path inside a Slurm filename pattern (--output/--error): `%` -> `%%` (kept although
    `prepare` refuses `%` in run directories: it is the rule for any path written into a pattern)."""
    return path.replace("%", "%%")


def sbatch_directive(key: str, value: Any) -> str:
    """One `#SBATCH --key=value` line, shell-quoted (submitit's own lines use the same convention)."""
    key = key.replace("_", "-")
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(check_directive_value(str(value), '--' + key))}"


def parse_extra_sbatch(options: Sequence[str]) -> dict[str, Any]:
    """`slurm.extra_sbatch` (["--exclusive", "--reservation=rl"]) -> {"exclusive": True, "reservation": "rl"}."""
    out: dict[str, Any] = {}
    for opt in options:
        if not opt.startswith("--") or len(opt) < 3:
            raise ValueError(f"slurm.extra_sbatch: {opt!r}: write long options, e.g. --exclusive or --reservation=NAME")
        key, sep, value = opt[2:].partition("=")
        out[key] = value if sep else True
    return out


class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """sacct lists a hetjob as `ID+0`, `ID+1`: also answer for `ID`, with the components' combined state."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        stats = super().read_info(string)
        comps: dict[str, list[dict[str, str]]] = {}
        for key, row in stats.items():
            m = _COMPONENT_RE.match(key)
            if m:
                comps.setdefault(m.group(1), []).append(row)
        for base, rows in comps.items():
            lead = stats.get(f"{base}+0", rows[0])
            stats[base] = {**lead, "State": combine_states([r.get("State", "") for r in rows])}
        return stats


class HetSlurmJob(SlurmJob):
    watcher = HetSlurmInfoWatcher(delay_s=30)


class HetSlurmExecutor(SlurmExecutor):
    """submitit's SlurmExecutor plus heterogeneous components (see the module docstring).

    `het_components`: one mapping of sbatch options per component after the first, e.g.
    `[{"nodes": 2, "ntasks-per-node": 4, "mem": "3G"}]`; the first component is described by the usual
    `update_parameters(...)`.
    """

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, het_components: Sequence[Mapping[str, Any]] = (), **kwargs: Any) -> None:
        super().__init__(folder, **kwargs)
        self.het_components = [dict(c) for c in het_components]

    @property
    def _submitit_command_str(self) -> str:
        # exec: the batch shell becomes the Python process, so --signal=B:USR1 reaches our handler
        return "exec " + super()._submitit_command_str

    def _num_tasks(self) -> int:
        return 1  # use_srun=False: the function runs once, in the batch step; it starts the srun step itself

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        if not self.het_components:
            return text
        lines = text.split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        extra = []
        for comp in self.het_components:
            extra.append("#SBATCH hetjob")
            extra += [sbatch_directive(k, v) for k, v in comp.items() if v is not None and v is not False]
        lines[last + 1:last + 1] = extra
        return "\n".join(lines)

    def submission_text(self) -> str:
        """The batch script `submit` would write, for --dry-run."""
        return self._make_submission_file_text(self._submitit_command_str, "dry-run")


@dataclass
class SubmitRequest:
    """What `hpcrl submit` was asked for; None: take it from the config."""

    config: str
    overrides: list[str] = field(default_factory=list)
    # worker nodes: a count, or "MIN-MAX" (Slurm grants what it can in the range; DP follows)
    nodes: int | str | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    requeue: bool | None = None
    # the split placement on nodes of its own: a third het group of this many rollout nodes; `nodes`
    # then counts the trainer's nodes
    rollout_nodes: int | None = None
    target: str = TRAINER_TARGET
    check_paths: bool = True


@dataclass
class Submission:
    """A prepared (and, after `submit()`, submitted) job."""

    cfg: Any
    run_dir: str
    folder: str
    job_name: str
    program_args: list[str]
    target: str
    executor: HetSlurmExecutor
    job_id: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    submission_file: str | None = None


def parse_nodes(nodes: int | str | None, problems: list[str]) -> tuple[int | None, int | None]:
    """--nodes N or MIN-MAX as (min, max); (None, None) when not given. Problems are appended."""
    if nodes is None:
        return None, None
    text = str(nodes).strip()
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if not m:
        problems.append(f"--nodes {text}: give a node count (4) or a range (2-4)")
        return None, None
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1 or hi < lo:
        problems.append(f"--nodes {text}: must be at least 1" if lo < 1 else
                        f"--nodes {text}: the range's end is below its start")
        return None, None
    return lo, hi


def _check_node_range(req: SubmitRequest, overrides: list[str], lo: int, hi: int) -> None:
    """Refuse a range with a node count the layout cannot use (Slurm may grant any of them), naming the
    counts that work."""
    from hpcrl.config import ConfigError, load_config
    from hpcrl.config.validate import value_problems

    bad: dict[int, str] = {}
    for n in range(lo, hi + 1):
        found = value_problems(load_config(req.config, [*overrides, f"trainer.nnodes={n}"]))
        if found:
            bad[n] = found[0]
    if bad:
        good = [n for n in range(lo, hi + 1) if n not in bad]
        n, why = next(iter(bad.items()))
        raise ConfigError([f"--nodes {lo}-{hi}: Slurm may grant any count in the range, and the layout cannot use "
                           f"{', '.join(map(str, bad))} node(s) (at {n}: {why}) "
                           + (f"Counts that work: {', '.join(map(str, good))}." if good else
                              "No count in the range works.")])


def _absolute_target(target: str) -> str:
    path, sep, func = target.partition(":")
    if path.endswith(".py"):
        return os.path.abspath(path) + sep + func
    return target


def prepare(req: SubmitRequest, cwd: str | None = None) -> Submission:
    """Resolve and validate the config for this allocation and build the executor; submits nothing.

    Raises ConfigError (exit 2, naming the key) for a bad config or option.
    """
    from hpcrl.config import ConfigError, load_config
    from hpcrl.trainer.preflight import preflight

    cwd = cwd or os.getcwd()
    cfg = load_config(req.config, req.overrides)  # first pass: what does the config say?
    extra: list[str] = []
    problems: list[str] = []
    lo, hi = parse_nodes(req.nodes, problems)
    if lo is not None and lo == hi:
        extra.append(f"trainer.nnodes={lo}")
    elif lo is not None and any(o.split("=", 1)[0].strip() == "trainer.nnodes" for o in req.overrides):
        problems.append(f"--nodes {req.nodes} with a trainer.nnodes override: the job takes its node count from "
                        "what Slurm grants; leave trainer.nnodes out")
    if req.gpus_per_node is not None:
        if req.gpus_per_node < 0:
            problems.append(f"--gpus-per-node {req.gpus_per_node}: must be 0 or more")
        extra.append(f"slurm.gpus_per_node={req.gpus_per_node}")
    gpus = req.gpus_per_node if req.gpus_per_node is not None else cfg.slurm.gpus_per_node
    if gpus and gpus > 0:
        extra.append(f"trainer.workers_per_node={gpus}")  # one worker per GPU
    rollout_nodes = req.rollout_nodes or 0
    if req.rollout_nodes is not None:
        if req.rollout_nodes < 1:
            problems.append(f"--rollout-nodes {req.rollout_nodes}: must be at least 1")
        per_node = gpus if gpus and gpus > 0 else cfg.trainer.workers_per_node
        if lo != hi:
            problems.append(f"--nodes {req.nodes} with --rollout-nodes: a range is for the colocated placement; "
                            "give the trainer's node count")
        trainer_nodes = lo if lo is not None else cfg.trainer.nnodes
        extra += [f"trainer.nnodes={trainer_nodes + rollout_nodes}", "trainer.placement=split",
                  f"trainer.rollout_workers={rollout_nodes * per_node}"]
    if req.partition is not None:
        extra.append(override("slurm.partition", req.partition))
    if req.time is not None:
        extra.append(override("slurm.time", req.time))
    if req.requeue is not None:
        extra.append(f"slurm.requeue={'true' if req.requeue else 'false'}")
    if problems:
        raise ConfigError(problems)
    cfg = load_config(req.config, [*req.overrides, *extra])
    run_dir = str(cfg.trainer.run_dir)
    if not os.path.isabs(run_dir):
        run_dir = os.path.abspath(os.path.join(cwd, run_dir))
        extra.append(override("trainer.run_dir", run_dir))
    final = [*req.overrides, *extra]
    if lo != hi:
        # the job learns its node count from the allocation (hpcrl.launch.allocation); here every count
        # Slurm may grant must give a usable layout, and the run is checked at the smallest
        _check_node_range(req, final, lo, hi)
        cfg = load_config(req.config, [*final, f"trainer.nnodes={lo}"])
    else:
        cfg = load_config(req.config, final)
    preflight(cfg, check_paths=req.check_paths)

    s = cfg.slurm
    try:
        minutes = parse_slurm_time(s.time)
    except ValueError as e:
        raise ConfigError([f"slurm.time={s.time!r}: {e}"]) from None
    folder = os.path.join(run_dir, "slurm")
    try:
        check_directive_value(folder, "trainer.run_dir")
        if "%" in folder:  # submitit rewrites %j/%t/%a/%A in its folder path; there is no escape for it
            raise ValueError(f"trainer.run_dir {run_dir!r}: '%' is not allowed in the run directory of "
                             "`hpcrl submit` (submitit would replace %j, %t, ... in it)")
        extra_opts = parse_extra_sbatch(list(s.extra_sbatch))
        for key in ("partition", "account", "qos", "mem_per_node", "constraint"):
            if s[key] is not None:
                check_directive_value(str(s[key]), f"slurm.{key}")
    except ValueError as e:
        raise ConfigError([str(e)]) from None

    job_name = safe_job_name(str(cfg.trainer.experiment))
    pattern_dir = slurm_filename_escape(folder)
    common = {"partition": s.partition, "account": s.account, "qos": s.qos}
    worker_nodes = f"{lo}-{hi}" if lo != hi else cfg.trainer.nnodes - rollout_nodes
    workers = {**common, "nodes": worker_nodes, "ntasks-per-node": cfg.trainer.workers_per_node,
               "cpus-per-task": s.cpus_per_worker, "mem": s.mem_per_node,
               "gpus-per-node": s.gpus_per_node or None, "constraint": s.constraint, **extra_opts}
    additional: dict[str, Any] = {
        "signal": f"B:USR1@{s.signal_before_s}",
        "open-mode": "append",
        "output": f"{pattern_dir}/%j_0_log.out",
        "error": f"{pattern_dir}/%j_0_log.err",
        "chdir": check_directive_value(cwd, "the submit directory"),
        ("requeue" if s.requeue else "no-requeue"): True,
        # "0" is all of a node's memory: right for the workers, a waste for the controller (site default then)
        **({"mem": s.mem_per_node} if s.mem_per_node and str(s.mem_per_node) != "0" else {}),
        **extra_opts,
    }
    # with --rollout-nodes a third group like the workers' (its ranks come last: the rollout side)
    groups = [workers, {**workers, "nodes": rollout_nodes}] if rollout_nodes else [workers]
    executor = HetSlurmExecutor(folder, het_components=groups, max_num_timeout=0)
    executor.update_parameters(
        job_name=job_name, time=minutes, nodes=1, ntasks_per_node=1, cpus_per_task=s.cpus_per_worker,
        use_srun=False, wckey=None, additional_parameters=additional,
        **{k: v for k, v in common.items() if v is not None})
    target = _absolute_target(req.target)
    return Submission(cfg=cfg, run_dir=run_dir, folder=folder, job_name=job_name,
                      program_args=[os.path.abspath(os.path.join(cwd, req.config)), *final], target=target,
                      executor=executor)


def submit(sub: Submission) -> Submission:
    """Submit a prepared job: snapshot the config, sbatch through submitit, write job.json, register it.

    The job runs a copy of CONFIG taken now (`{run_dir}/slurm/config.yaml`), so editing the file while
    the job waits or is requeued changes nothing; relative paths inside it still resolve against the
    submit directory, where the job runs.
    """
    from hpcrl.launch.jobs import register_job

    os.makedirs(sub.folder, exist_ok=True)
    snapshot = os.path.join(sub.folder, "config.yaml")
    tmp = f"{snapshot}.tmp.{os.getpid()}"
    shutil.copyfile(sub.program_args[0], tmp)
    os.replace(tmp, snapshot)
    args = [snapshot, *sub.program_args[1:]]
    job = sub.executor.submit(submitit_entry, sub.target, args, True)
    sub.job_id = str(job.job_id)
    sub.program_args = args
    sub.stdout = str(job.paths.stdout)
    sub.stderr = str(job.paths.stderr)
    sub.submission_file = str(job.paths.submission_file)
    info = {
        "job_id": sub.job_id, "run_dir": sub.run_dir, "folder": sub.folder, "stdout": sub.stdout,
        "stderr": sub.stderr, "submission_file": sub.submission_file, "submitted_at": time.time(),
        "submit_dir": os.getcwd(), "target": sub.target, "argv": args, "job_name": sub.job_name,
        "nodes": sub.cfg.trainer.nnodes, "workers_per_node": sub.cfg.trainer.workers_per_node,
        "gpus_per_node": sub.cfg.slurm.gpus_per_node, "partition": sub.cfg.slurm.partition,
        "python": sys.executable,
    }
    write_json_atomic(os.path.join(sub.folder, "job.json"), info)
    register_job(sub.job_id, sub.run_dir, source="hpcrl submit")
    return sub
