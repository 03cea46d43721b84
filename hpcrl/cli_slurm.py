"""`hpcrl submit`, `hpcrl status`, `hpcrl cancel`: the Slurm side of the command line.

Kept out of hpcrl/cli.py so the two can change independently; `hpcrl.cli.build_parser` calls
`add_commands(sub)`. Every subcommand returns an exit status: 0 ok, 1 Slurm refused or failed,
2 a bad config or option (printed by hpcrl.cli.main, naming the key), 3 no such job.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

EXIT_SLURM = 1
EXIT_NO_JOB = 3


def _q(path: str) -> str:
    """A path as the user can paste it into a shell."""
    return shlex.quote(path)


def cmd_submit(args: argparse.Namespace) -> int:
    """Validate, then submit the hetjob through submitit; print the job id, logs and how to follow them."""
    from hpcrl.cli_args import print_config_warnings

    if args.join:  # a rollout pool for a running run (hpcrl.cli_pools)
        from hpcrl.cli_pools import submit_join

        return submit_join(args)
    if not args.config:
        print("hpcrl submit: CONFIG is required (or --join RUN_DIR --rollout-nodes K for a rollout pool)",
              file=sys.stderr)
        return 2
    from hpcrl.launch.slurm_query import is_active
    from hpcrl.launch.submit import SubmitRequest, prepare, submit

    if args.verbose:  # the job's terminal is its Slurm log: every rank's library output goes there too
        args.overrides = [*args.overrides, "logging.verbose=true"]
    try:
        req = SubmitRequest(config=args.config, overrides=list(args.overrides), nodes=args.nodes,
                            gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time,
                            requeue=args.requeue, rollout_nodes=args.rollout_nodes, target=args.target,
                            check_paths=not args.skip_path_checks)
        sub = prepare(req)
    except RuntimeError as e:  # submitit: no srun on PATH
        print(f"hpcrl submit: {e}", file=sys.stderr)
        return EXIT_SLURM
    print_config_warnings(sub.cfg, "submit")
    if args.dry_run:
        print(sub.executor.submission_text())
        print(f"# the batch step then runs (through submitit): {sub.target} "
              + " ".join(_q(a) for a in sub.program_args))
        return 0
    previous = os.path.join(sub.folder, "job.json")
    try:
        with open(previous, encoding="utf-8") as f:
            old = str(json.load(f).get("job_id", ""))
    except (OSError, ValueError):
        old = ""
    if old and is_active(old):
        print(f"hpcrl submit: run {sub.run_dir} already has job {old} queued or running; wait for it, "
              f"`hpcrl cancel {old}`, or choose another trainer.experiment / trainer.run_dir", file=sys.stderr)
        return EXIT_SLURM
    try:
        sub = submit(sub)
    except Exception as e:  # sbatch refused (bad partition, limits, ...): show Slurm's words
        print(f"hpcrl submit: sbatch failed: {str(e).strip()}", file=sys.stderr)
        return EXIT_SLURM
    cfg = sub.cfg
    if args.json:
        print(json.dumps({"job_id": sub.job_id, "run_dir": sub.run_dir, "folder": sub.folder,
                          "stdout": sub.stdout, "stderr": sub.stderr, "submission_file": sub.submission_file}))
        return 0
    gpus = cfg.slurm.gpus_per_node
    rollout = f" (the last {args.rollout_nodes} for the rollout engines)" if args.rollout_nodes else ""
    nodes = args.nodes if args.nodes and "-" in str(args.nodes) else cfg.trainer.nnodes
    print(f"hpcrl submit: job {sub.job_id} ({sub.job_name}): 1 controller + {nodes} node(s){rollout} x "
          f"{cfg.trainer.workers_per_node} worker(s){f', {gpus} GPU(s) per node' if gpus else ''}, "
          f"partition {cfg.slurm.partition or '(default)'}, time {cfg.slurm.time}")
    print(f"  run dir   {sub.run_dir}")
    print(f"  job log   {sub.stdout}")
    print(f"            {sub.stderr}")
    print(f"  metrics   {os.path.join(sub.run_dir, 'metrics.jsonl')}")
    print(f"  follow    tail -F {_q(sub.stdout)} {_q(sub.stderr)}")
    print(f"  status    hpcrl status {sub.job_id}")
    print(f"  cancel    hpcrl cancel {sub.job_id}")
    return 0


def _status_lines(st: Any) -> list[str]:
    comps = ", ".join(f"{c.job_id} {c.state}" + (f" on {c.nodes}" if c.nodes and c.nodes != "None assigned" else "")
                      for c in st.components)
    step = "-" if st.step is None else str(st.step)
    lines = [f"job {st.job_id} ({st.name}): {st.state}, elapsed {st.elapsed or '-'}, restarts {st.restarts}, "
             f"step {step}", f"  components  {comps}"]
    if st.run_dir:
        lines.append(f"  run dir     {st.run_dir}")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    """State, elapsed, restarts (sacct/squeue/scontrol) and the run's current step (its metrics.jsonl)."""
    from hpcrl.launch.jobs import JOB_ID_RE, lookup_run_dir, recent_jobs
    from hpcrl.launch.slurm_query import job_status

    if args.job is not None and os.path.isdir(args.job):  # a run directory: the run and its rollout pools
        from hpcrl.cli_pools import status_run_dir

        return status_run_dir(args.job, args.json)
    if args.job is None:
        entries = recent_jobs(args.last)
        if not entries:
            print("hpcrl status: no jobs recorded yet (hpcrl submit and sbatch/*.sh record theirs)")
            return 0
        found = [job_status(str(e["job_id"]), str(e["run_dir"])) for e in entries]
        if args.json:
            print(json.dumps([st.to_dict() for st in found if st is not None]))
            return 0
        for e, st in zip(entries, found):
            if st is None:
                print(f"job {e['job_id']}: unknown to Slurm now  ({e['run_dir']})")
            else:
                print(_status_lines(st)[0] + f"  ({st.run_dir})")
        return 0
    if not JOB_ID_RE.match(args.job):
        print(f"hpcrl status: {args.job!r} is not a job id (e.g. 123 or 123+1)", file=sys.stderr)
        return 2
    run_dir = args.run_dir or lookup_run_dir(args.job)
    st = job_status(args.job, run_dir)
    if st is None:
        print(f"hpcrl status: Slurm knows no job {args.job}", file=sys.stderr)
        return EXIT_NO_JOB
    if args.json:
        print(json.dumps(st.to_dict()))
    else:
        print("\n".join(_status_lines(st)))
        if run_dir:
            job_json = os.path.join(run_dir, "slurm", "job.json")
            try:
                with open(job_json, encoding="utf-8") as f:
                    info = json.load(f)
                if str(info.get("job_id")) == st.job_id and info.get("stdout"):
                    print(f"  job log     {info['stdout']}")
            except (OSError, ValueError):
                pass
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """scancel the job (all het components: the leader's id covers them)."""
    import subprocess

    from hpcrl.launch.jobs import JOB_ID_RE

    if not JOB_ID_RE.match(args.job):  # never hand scancel something it could read as an option
        print(f"hpcrl cancel: {args.job!r} is not a job id (e.g. 123)", file=sys.stderr)
        return 2
    try:
        r = subprocess.run(["scancel", args.job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"hpcrl cancel: scancel failed: {e}", file=sys.stderr)
        return EXIT_SLURM
    if r.returncode != 0 or r.stderr.strip():
        msg = (r.stderr or r.stdout).strip()
        print(f"hpcrl cancel: scancel {args.job}: {msg}", file=sys.stderr)
        return EXIT_NO_JOB if "Invalid job id" in msg else EXIT_SLURM
    print(f"hpcrl cancel: cancel requested for job {args.job}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register submit, status and cancel on the `hpcrl` parser."""
    from hpcrl.cli_args import add_config_arguments, add_verbose_argument

    p = sub.add_parser("submit", help="submit a run as a Slurm heterogeneous job (controller + worker nodes)",
                       description="Validate CONFIG (exit 2 naming the key), then submit one heterogeneous job: "
                                   "het group 0 = the controller (1 task), het group 1 = NODES x workers "
                                   "(with --rollout-nodes, het group 2 = the rollout nodes). "
                                   "Logs and job files go to {trainer.run_dir}/slurm/.")
    add_config_arguments(p, optional=True)
    p.add_argument("--join", metavar="RUN_DIR",
                   help="submit a rollout pool for the running run in RUN_DIR instead (with --rollout-nodes K; "
                        "split placement, rollout.mode=fully_async): its K nodes' vLLM workers join the run, take "
                        "prompts from the next update on, and leave when the job ends")
    p.add_argument("--nodes", type=lambda v: int(v) if v.strip().isdigit() else v,
                   help="worker nodes (sets trainer.nnodes; default: the config's), or MIN-MAX: Slurm grants what it "
                        "can in the range, DP follows, TP/PP stay")
    p.add_argument("--rollout-nodes", type=int,
                   help="M more nodes for the vLLM engines alone, in a third het group (sets trainer.placement=split, "
                        "trainer.rollout_workers = M x workers per node, trainer.nnodes = NODES + M)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs per worker node, one worker each (sets slurm.gpus_per_node and "
                        "trainer.workers_per_node; default: the config's; 0: CPU workers)")
    p.add_argument("--partition", help="Slurm partition of both components (sets slurm.partition)")
    p.add_argument("--time", help="time limit, e.g. 30, 04:00:00 or 2-00:00:00 (sets slurm.time)")
    p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None,
                   help="may Slurm requeue the job after preemption or a node failure (sets slurm.requeue; "
                        "default: the config's)")
    p.add_argument("--target", default="hpcrl.trainer.main:main",
                   help="controller program prog.py[:func] or package.module[:func]; it gets CONFIG KEY=VALUE... "
                        "as its arguments (default: the trainer)")
    add_verbose_argument(p)
    p.add_argument("--dry-run", action="store_true", help="print the batch script and the program; submit nothing")
    p.add_argument("--json", action="store_true", help="print the job id and paths as one JSON object")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="state, elapsed time, restarts and current step of a job (or recent jobs)")
    p.add_argument("job", nargs="?", help="Slurm job id, or a run directory (the run's step and rollout pools); "
                                          "without it: the jobs recorded most recently")
    p.add_argument("--run-dir", help="the run's directory, when the job registry does not know the job")
    p.add_argument("--last", type=int, default=10, help="how many recent jobs to list without JOB (10)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel a job (both het components)")
    p.add_argument("job", help="Slurm job id")
    p.set_defaults(func=cmd_cancel)
