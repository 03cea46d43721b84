"""`hpcrl pool RUN_DIR`, `hpcrl submit --join RUN_DIR --rollout-nodes K` and `hpcrl status RUN_DIR`:
the command line of the rollout pools (hpcrl.pools). Exit status 2: the run cannot take a pool (not
running, not split and fully asynchronous, another model or config), nothing submitted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EXIT_NOT_JOINABLE = 2


def cmd_pool(args: argparse.Namespace) -> int:
    """One pool worker in this process (each task of a pool job runs this)."""
    from hpcrl.pools.member import serve

    return serve(args.run_dir, list(args.overrides), pool=args.pool, index=args.index)


def join_preflight(run_dir: str, config: str | None, overrides: list[str]) -> Any:
    """The run's config if a pool may join it now (else NotJoinable): the run takes pools and runs, and
    CONFIG (when given, with its overrides) has the run's model and sampling."""
    from hpcrl.config.loader import load_config
    from hpcrl.pools.member import pool_config
    from hpcrl.pools.wire import NotJoinable, connect, find_controller, fingerprint, fingerprint_differences

    info = find_controller(run_dir)
    cfg = pool_config(Path(run_dir), [] if config else overrides)
    if config:
        differs = fingerprint_differences(fingerprint(cfg), fingerprint(load_config(config, overrides)))
        if differs:
            raise NotJoinable(f"{config} does not describe the run in {run_dir}: " + "; ".join(differs)
                              + " (leave CONFIG out to use the run's own)")
    connect(info, timeout_s=10.0).close()  # the controller answers (the registry drops a silent connection)
    return cfg


def pool_job_script(run_dir: str, cfg: Any, nodes: int, partition: str | None, time_limit: str | None,
                    gpus_per_node: int | None, overrides: list[str] | None = None) -> str:
    """The sbatch script of a pool: NODES x workers per node tasks (the GPUs per node, else
    trainer.workers_per_node), each `hpcrl pool RUN_DIR KEY=VALUE...`."""
    s = cfg.slurm
    gpus = s.gpus_per_node if gpus_per_node is None else gpus_per_node
    per_node = gpus or int(cfg.trainer.workers_per_node)
    out = os.path.join(os.path.abspath(run_dir), "pools", "slurm-%j.out")
    lines = ["#!/bin/bash", f"#SBATCH --job-name=hpcrl-pool-{cfg.trainer.experiment}"[:200],
             f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={per_node}",
             f"#SBATCH --cpus-per-task={s.cpus_per_worker}", f"#SBATCH --time={time_limit or s.time}",
             f"#SBATCH --output={out}", "#SBATCH --no-requeue"]
    for key, value in (("partition", partition or s.partition), ("account", s.account), ("qos", s.qos),
                       ("mem", s.mem_per_node), ("constraint", s.constraint)):
        if value:
            lines.append(f"#SBATCH --{key}={value}")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    run = shlex.quote(os.path.abspath(run_dir))
    lines += [f"export OMP_NUM_THREADS={s.cpus_per_worker}",
              f"srun --mpi=none {shlex.quote(sys.executable)} -m hpcrl.cli pool {run}"
              + "".join(f" {shlex.quote(o)}" for o in overrides or [])]
    return "\n".join(lines) + "\n"


def submit_join(args: argparse.Namespace) -> int:
    """`hpcrl submit --join RUN_DIR --rollout-nodes K [CONFIG KEY=VALUE...]`: a pool job for a running run."""
    from hpcrl.launch.jobs import register_job
    from hpcrl.pools.wire import NotJoinable, pools_dir

    if args.config and "=" in args.config and not os.path.exists(args.config):  # KEY=VALUE, no CONFIG
        args.config, args.overrides = None, [args.config, *args.overrides]
    if not args.rollout_nodes or args.rollout_nodes < 1:
        print("hpcrl submit: --join needs --rollout-nodes K (K >= 1): the nodes of the pool", file=sys.stderr)
        return EXIT_NOT_JOINABLE
    try:
        cfg = join_preflight(args.join, args.config, list(args.overrides))
    except NotJoinable as e:
        print(f"hpcrl submit: cannot join: {e}", file=sys.stderr)
        return EXIT_NOT_JOINABLE
    # without CONFIG the overrides are the pool's own (engine settings, workers per node), passed to each task
    script = pool_job_script(args.join, cfg, args.rollout_nodes, args.partition, args.time, args.gpus_per_node,
                             [] if args.config else list(args.overrides))
    if args.dry_run:
        print(script, end="")
        return 0
    folder = pools_dir(args.join)
    path = folder / f"job-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sh"
    path.write_text(script)
    r = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"hpcrl submit: sbatch failed: {(r.stderr or r.stdout).strip()}", file=sys.stderr)
        return 1
    job_id = r.stdout.strip().split(";")[0]
    register_job(job_id, args.join, kind="rollout pool")
    log = folder / f"slurm-{job_id}.out"
    if args.json:
        print(json.dumps({"job_id": job_id, "run_dir": os.path.abspath(args.join), "stdout": str(log),
                          "submission_file": str(path)}))
        return 0
    print(f"hpcrl submit: job {job_id}: a rollout pool of {args.rollout_nodes} node(s) for the run in {args.join}")
    print(f"  job log   {log}")
    print(f"  pools     hpcrl status {shlex.quote(args.join)}")
    print(f"  leave     scancel {job_id}  (its prompts in flight go back to the run's other engines)")
    return 0


def pool_status_lines(run_dir: str) -> list[str]:
    """The run's pools (RUN_DIR/pools/state.json) as `hpcrl status RUN_DIR` prints them."""
    from hpcrl.launch.slurm_query import last_step
    from hpcrl.pools.wire import CONTROLLER_FILE, STATE_FILE, pid_alive, pools_dir, read_json

    d = pools_dir(run_dir)
    controller = read_json(d / CONTROLLER_FILE)
    state = read_json(d / STATE_FILE) or {}
    step = last_step(run_dir)
    running = bool(controller) and (controller.get("host") != os.uname().nodename
                                    or pid_alive(int(controller.get("pid", 0))))
    head = (f"run {run_dir}: {'running' if running else 'not running'}, step {step if step is not None else '-'}"
            + (f", Slurm job {controller['job_id']}" if controller and controller.get("job_id") else ""))
    lines = [head]
    if controller and running:
        lines.append(f"  pools join  hpcrl submit --join {shlex.quote(run_dir)} --rollout-nodes K")
    workers = state.get("workers") or []
    if not workers:
        lines.append("  pools       none" + ("" if controller or state else " (this run takes no pools: "
                                            "trainer.placement=split and rollout.mode=fully_async do)"))
        return lines
    by_pool: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        by_pool.setdefault(str(w.get("pool")), []).append(w)
    for pool, ws in by_pool.items():
        states = ", ".join(f"{n} {s}" for s, n in sorted(_count(w.get("state") for w in ws).items()))
        lines.append(f"  pool {pool}: {len(ws)} worker(s): {states}")
        for w in ws:
            extra = f" ({w['why_gone']})" if w.get("why_gone") else ""
            lines.append(f"    {w.get('member')}  {w.get('state')}  host {w.get('host')} pid {w.get('pid')}  "
                         f"weights {w.get('weights_version')}  {w.get('segments')} segment(s), "
                         f"{w.get('tokens')} token(s){extra}")
    return lines


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def status_run_dir(run_dir: str, as_json: bool) -> int:
    from hpcrl.pools.wire import STATE_FILE, pools_dir, read_json

    if as_json:
        print(json.dumps(read_json(pools_dir(run_dir) / STATE_FILE) or {}))
        return 0
    print("\n".join(pool_status_lines(run_dir)))
    return 0


def add_pool_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pool", help="join a running split, fully_async run as one rollout pool worker (what each "
                                    "task of `hpcrl submit --join` runs)")
    p.add_argument("run_dir", help="the running run's directory (trainer.run_dir)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="engine settings of this worker, e.g. rollout.gpu_memory_utilization=0.8 (what decides the "
                        "samples must stay the run's)")
    p.add_argument("--pool", help="the pool's name (default: $SLURM_JOB_ID, else host-pid)")
    p.add_argument("--index", type=int, help="this worker's index in the pool (default: $SLURM_PROCID, else 0)")
    p.set_defaults(func=cmd_pool)
