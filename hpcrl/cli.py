"""The `hpcrl` command.

Every subcommand that takes a config loads and validates it first, so a bad key or layout exits
with status 2 and a message naming the key before anything is launched or allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from hpcrl import __version__
from hpcrl.cli_args import IntermixedParser, add_config_arguments, add_verbose_argument, print_config_warnings
from hpcrl.config import (
    ConfigError,
    is_dpo,
    load_config,
    reference_enabled,
    role_layouts,
    rollout_layout,
    to_yaml,
    world_size,
)
from hpcrl.config.derived import is_split, rollout_mode, staleness_depth, stream_staleness, trainer_world_size
from hpcrl.plan import add_plan_arguments, cluster_for_plan, memory_plan
from hpcrl.plan.report import worker_span
from hpcrl.trainer.preflight import preflight, read_hf_config

EXIT_CONFIG = 2


def load_validated(args: argparse.Namespace) -> DictConfig:
    cfg = load_config(args.config, args.overrides)
    preflight(cfg, check_paths=not args.skip_path_checks)
    print_config_warnings(cfg, args.command)
    return cfg


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_validated(args)
    if args.format == "json":
        print(json.dumps(OmegaConf.to_container(cfg, resolve=True), indent=2))
    else:
        print(to_yaml(cfg), end="")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what a run of this config will occupy: ranks, layouts, batch arithmetic, then whether it
    fits in memory (hpcrl.plan)."""
    recipe = load_config(args.config, args.overrides)
    # --nodes / --gpus-per-node first: a layout that needs the larger cluster is validated on it
    cfg, change = cluster_for_plan(recipe, args)
    if change.problems:
        if change.fewest_nodes is not None or _valid(recipe):
            return change.refuse(cfg, args)  # the layout, not the config, is what does not fit these nodes
        raise ConfigError(change.problems)
    preflight(cfg, check_paths=not args.skip_path_checks)
    print_config_warnings(cfg, args.command)
    w = world_size(cfg)
    lines = [f"workers     {w} = trainer.nnodes {cfg.trainer.nnodes} x trainer.workers_per_node "
             f"{cfg.trainer.workers_per_node}, plus 1 controller rank (MPI world of {w + 1})"]
    if is_split(cfg):
        t = trainer_world_size(cfg)
        mode = rollout_mode(cfg)
        overlap = {"sync": "each step generates its batch, then trains (rollout.mode=sync)",
                   "one_step_off": f"generation runs {staleness_depth(cfg)} step(s) ahead of training "
                                   "(rollout.mode=one_step_off, rollout.max_staleness)",
                   "fully_async": f"the engines generate without pause, each trained token at most "
                                  f"{stream_staleness(cfg)} version(s) behind (rollout.mode=fully_async)"}[mode]
        lines.append(f"placement   split: {worker_span(1, t)} train, {worker_span(t + 1, w)} run the vLLM engines; "
                     + overlap)
    elif not is_dpo(cfg):
        lines.append("placement   colocated: every worker trains and runs a vLLM engine, taking turns "
                     "(trainer.placement=split gives the engines workers of their own)")
    for role, lay in role_layouts(cfg).items():
        note = " (colocated with the actor)" if role == "reference" and cfg.reference.parallel is None else ""
        lines.append(f"{role:<11} {lay}{note}")
    if is_dpo(cfg):
        d = cfg.algorithm.dpo
        lines.append(f"per step    {cfg.data.train_batch_size} preference pairs = {2 * cfg.data.train_batch_size} "
                     "sequences; one optimizer step")
        lines.append(f"algorithm   dpo ({d.loss_type} loss, beta {d.beta:g}, label smoothing {d.label_smoothing:g}), "
                     "reference on, no rollout engine")
    else:
        r = rollout_layout(cfg)
        lines.append(f"rollout     TP={r.tp} DP={r.dp}: {r.dp} vLLM engine(s) of {r.tp} rank(s) each")
        samples = cfg.data.train_batch_size * cfg.rollout.n
        n_mb = samples // cfg.actor.ppo_mini_batch_size
        lines.append(f"per step    {cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples = {samples} samples; "
                     f"actor: {n_mb} mini-batch(es) x {cfg.actor.ppo_epochs} epoch(s) = "
                     f"{n_mb * cfg.actor.ppo_epochs} optimizer step(s)")
        lines.append(f"algorithm   {cfg.algorithm.adv_estimator} advantages, {cfg.algorithm.policy_loss} loss, "
                     f"reference {'on' if reference_enabled(cfg) else 'off'}")
    if not args.skip_path_checks:
        hf = read_hf_config(cfg.model.path)
        arch = (hf.get("architectures") or ["?"])[0]
        lines.append(f"model       {arch}: {hf['num_hidden_layers']} layers, {hf['num_attention_heads']} heads / "
                     f"{hf.get('num_key_value_heads', hf['num_attention_heads'])} KV heads, "
                     f"hidden {hf.get('hidden_size')}, vocab {hf.get('vocab_size')}")
    gpus = cfg.slurm.gpus_per_node
    lines.append(f"slurm       het group 0: 1 node x 1 task (controller); het group 1: {cfg.trainer.nnodes} "
                 f"node(s) x {cfg.trainer.workers_per_node} task(s)"
                 + (f", {gpus} GPU(s) per node" if gpus else ", CPU workers"))
    lines.append(f"run dir     {cfg.trainer.run_dir}")
    print("\n".join(lines))
    return memory_plan(cfg, args, change)


def _valid(cfg: DictConfig) -> bool:
    """The config passes validation without its path checks."""
    try:
        preflight(cfg, check_paths=False)
    except ConfigError:
        return False
    return True


def cmd_run(args: argparse.Namespace) -> int:
    """Run a config on this machine: one controller + the config's workers under mpiexec."""
    import os
    import subprocess
    from pathlib import Path

    from hpcrl.launch import entry_argv, mpiexec_command
    from hpcrl.launch.commands import rank_output_env

    if args.verbose:
        args.overrides = [*args.overrides, "logging.verbose=true"]  # also in the saved config
    cfg = load_validated(args)
    w = world_size(cfg)
    argv = mpiexec_command(w, entry_argv("hpcrl.trainer.main:main", [str(Path(args.config).resolve()),
                                                                      *args.overrides]))
    log_dir = Path(cfg.logging.dir).resolve()
    print(f"hpcrl run: {cfg.trainer.experiment}: 1 controller + {w} workers on this machine; "
          f"run dir {cfg.trainer.run_dir}" + ("" if cfg.logging.verbose else
                                               f"; every rank's full output in {log_dir}/rank*.log"), flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # every rank is a process; threads would oversubscribe
    # vLLM's INFO lines (engine set-up, memory per step) go to each rank's file; on a verbose terminal
    # they would be per-step chatter from every worker
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if cfg.logging.verbose else "INFO")
    # each rank keeps its output in {logging.dir}/rank{R}.{host}.log; the terminal shows what
    # logging.verbose says (launchers/hpcrl_entry.py)
    env.update(rank_output_env(cfg))
    try:
        return subprocess.run(argv, env=env).returncode
    except KeyboardInterrupt:
        return 130


def cmd_plot(args: argparse.Namespace) -> int:
    """PNGs of a run's metrics (hpcrl.report.plots)."""
    from hpcrl.report.plots import NoMetricsError, plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except NoMetricsError as e:
        print(f"hpcrl plot: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl", description="Slurm-first reinforcement learning for LLMs (PPO, GRPO and relatives).")
    parser.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    # every sub-command takes its options before or after its positionals (CONFIG KEY=VALUE ... --nodes 2)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=IntermixedParser)

    p = sub.add_parser("config", help="print the resolved, validated config")
    add_config_arguments(p)
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("plan", help="print the ranks, parallel layouts, batch arithmetic and memory per GPU or worker "
                                    "of a config, and whether it fits (exit status 3 when it does not)")
    add_config_arguments(p)
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="run a config on this machine (controller + workers under mpiexec)")
    add_config_arguments(p)
    add_verbose_argument(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plot", help="PNGs of a run's metrics: rewards, lengths, KL/entropy, time per phase, memory")
    p.add_argument("run_dir", help="the run directory (trainer.run_dir): reads metrics.jsonl and validation.jsonl")
    p.add_argument("--out", help="where the PNGs go (default RUN_DIR/plots)")
    p.set_defaults(func=cmd_plot)

    from hpcrl.cli_ckpt import add_commands as add_ckpt_commands
    from hpcrl.cli_pools import add_pool_command
    from hpcrl.cli_slurm import add_commands as add_slurm_commands

    add_slurm_commands(sub)  # submit, status, cancel
    add_ckpt_commands(sub)  # ckpt list / verify / export-hf
    add_pool_command(sub)  # pool RUN_DIR (a rollout pool worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"hpcrl {args.command}: invalid config ({len(e.problems)} problem(s)):", file=sys.stderr)
        for problem in e.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
