"""What `hpcrl plan` prints after the layouts: the memory table per phase, the peak, the verdict and
what to change when a run does not fit; and the comparison with a finished run's measured peaks.
The command's options, the --nodes / --gpus-per-node change and the inputs it reads (the models'
shapes, the memory to compare with) are here too; the search for what to change is suggest.py's.

Exit statuses of `hpcrl plan` (also in its --help and docs/planner.md): 0 fits (or no verdict could
be made: no model config.json here, or a CPU plan without a memory size to compare with; said in
the output), 2 invalid config or arguments, 3 does not fit (memory, or the layout cannot be placed
on the --nodes / --gpus-per-node given), 1 --compare found no measured memory in the run directory.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hpcrl.config import ConfigError, critic_enabled, role_layouts, validate, world_size
from hpcrl.config.derived import engine_roles, is_split, trainer_world_size
from hpcrl.config.validate import arithmetic_problems, range_problems
from hpcrl.plan import fsdp
from hpcrl.plan.activations import GB, GIB, plan_device
from hpcrl.plan.memory import PHASE_MEANING, Estimate, RoleShapes, estimate, estimate_rollout_worker
from hpcrl.plan.moe import experts_line
from hpcrl.plan.shape import ModelConfigError, read_model_shape
from hpcrl.plan.suggest import Planner, _Inputs, _unit_name, best_placeable, suggest

EXIT_FITS = 0
EXIT_NO_METRICS = 1
EXIT_INVALID = 2
EXIT_DOES_NOT_FIT = 3

EXIT_STATUS_HELP = ("exit status: 0 fits (or no memory verdict could be made, said in the output), 2 invalid config "
                    "or arguments, 3 does not fit (memory, or the layout cannot be placed on --nodes x "
                    "--gpus-per-node), 1 --compare found no memory/rss_gb_max in the run directory")
COLUMN = {"rollout": "rollout", "reshard": "reshard", "transfer": "transfer", "receive": "receive",
          "forward": "forward", "update actor": "upd actor", "update critic": "upd critic",
          "optimizer step": "opt step"}


# -- arguments ------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    """--nodes / --gpus-per-node: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return value


def gpu_mem_gib(text: str) -> float:
    """--gpu-mem: GiB of one GPU, a finite number > 0 (an H100 has 80, an H200 141)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be the memory of one GPU in GiB, a number > 0 such as 80 "
                                         f"(got {text!r})")
    return value


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The memory planner's options of `hpcrl plan`."""
    p.add_argument("--nodes", type=_positive_int, metavar="N",
                   help="plan for N nodes (overrides trainer.nnodes; a recipe's data_parallel is re-derived)")
    p.add_argument("--gpus-per-node", type=_positive_int, metavar="G",
                   help="plan for G workers (GPUs) per node (overrides trainer.workers_per_node and "
                        "slurm.gpus_per_node)")
    p.add_argument("--gpu-mem", type=gpu_mem_gib, metavar="GiB",
                   help="memory of one GPU in GiB (default 80); plans a trainer.device=auto recipe for GPUs")
    p.add_argument("--model-config", metavar="PATH",
                   help="the model's HF config.json, when model.path is not on this machine "
                        "(configs/models/llama3-70b.json: Llama-3-70B)")
    p.add_argument("--compare", metavar="RUN_DIR",
                   help="print the estimate next to the peak memory a run measured (RUN_DIR/metrics.jsonl)")
    p.epilog = EXIT_STATUS_HELP


# -- --nodes / --gpus-per-node ----------------------------------------------------------------------
@dataclass
class ClusterChange:
    """What --nodes / --gpus-per-node changed, and why the layout cannot be placed (if it cannot)."""

    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fewest_nodes: int | None = None  # the fewest nodes (as many workers each) that place the layout

    def refuse(self, cfg: DictConfig, args: argparse.Namespace) -> int:
        """Print why the run cannot be placed on these nodes, and what the layouts that can be
        would need; the does-not-fit status."""
        nodes, per_node = cfg.trainer.nnodes, cfg.trainer.workers_per_node
        print(f"plan for {nodes} node(s) x {per_node} worker(s) = {nodes * per_node} workers: the layout cannot "
              "be placed")
        for note in self.notes:
            print(f"note        {note}")
        for problem in self.problems:
            print(f"  - {problem}")
        more = (f"--nodes {self.fewest_nodes} (trainer.nnodes={self.fewest_nodes}) is the fewest that place it"
                if self.fewest_nodes else "more nodes")
        print(f"verdict     does not fit on {nodes} node(s): {more}; or a smaller TP x PP x CP that divides the "
              "workers (actor.parallel.tensor_parallel / pipeline_parallel / context_parallel), which puts more of "
              "the model, or of each sequence, on each GPU")
        inputs = _read_inputs(cfg, args)
        if not isinstance(inputs, int):
            alternative = best_placeable(cfg, inputs)
            if alternative:
                print(f"            {alternative}")
        return EXIT_DOES_NOT_FIT


def cluster_for_plan(cfg: DictConfig, args: argparse.Namespace) -> tuple[DictConfig, ClusterChange]:
    """The config with --nodes / --gpus-per-node applied. A `data_parallel` cross-check that no
    longer matches is re-derived (it is only a cross-check: DP is what TP x PP leave); the layout
    is validated again for the new world size."""
    change = ClusterChange()
    nodes, per_node = getattr(args, "nodes", None), getattr(args, "gpus_per_node", None)
    if nodes is None and per_node is None:
        return cfg, change
    new = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if nodes is not None:
        new.trainer.nnodes = nodes
    if per_node is not None:
        new.trainer.workers_per_node = per_node
        if new.trainer.device != "cpu":  # one worker per GPU
            new.slurm.gpus_per_node = per_node
    w = world_size(new)
    for role in ("actor", "critic", "reference"):
        par = new[role].get("parallel")
        if par is None or par.get("data_parallel") is None:
            continue
        model_parallel = par.tensor_parallel * par.pipeline_parallel * par.context_parallel
        if par.data_parallel * model_parallel != w:
            derived = w // model_parallel if model_parallel and w % model_parallel == 0 else None
            names = "TP x PP x CP" if par.context_parallel > 1 else "TP x PP"
            change.notes.append(
                f"{role}.parallel.data_parallel={par.data_parallel} is for the recipe's "
                f"{world_size(cfg)} workers; " + (f"re-derived as {derived} for {w} (pass {role}.parallel."
                                                  f"data_parallel={derived} or null when you run it)"
                                                  if derived else f"dropped: {names} = {model_parallel} does not "
                                                                  f"divide {w}"))
            par.data_parallel = None
    try:
        validate(new)
    except ConfigError as e:
        change.problems = e.problems
        change.fewest_nodes = _fewest_nodes(new)
    return new, change


def _fewest_nodes(cfg: DictConfig, most: int = 1024) -> int | None:
    """The fewest nodes of trainer.workers_per_node workers on which the config's layout validates. None when
    none does, at once for a value wrong on any number of nodes (a range, a choice): the search validated the
    whole config at each of the 1024 counts, ~10 s of `hpcrl plan` for `rollout.n=0`."""
    trial = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if range_problems(trial):
        return None
    for nodes in range(1, most + 1):
        trial.trainer.nnodes = nodes
        if not arithmetic_problems(trial):
            return nodes
    return None


# -- the model's shape ----------------------------------------------------------------------------
def read_shapes(cfg: DictConfig, model_config: str | None) -> tuple[RoleShapes, list[str]]:
    """The shapes the plan uses, and lines saying where each came from. ModelConfigError when the
    policy's config.json is not here and no --model-config was given."""
    lines = []
    if model_config:
        policy = read_model_shape(model_config)
        lines.append(f"model       {policy.source} (--model-config): {policy.describe()}")
    else:
        try:
            policy = read_model_shape(cfg.model.path)
        except ModelConfigError as e:
            raise ModelConfigError(f"{e}. model.path={cfg.model.path!r} is not on this machine: pass "
                                   "--model-config PATH, a config.json of the same model "
                                   "(configs/models/llama3-70b.json holds Llama-3-70B's)") from None
        lines.append(f"model       {policy.source} (model.path): {policy.describe()}")
    critic = None
    if critic_enabled(cfg) and cfg.critic.model_path:
        try:
            critic = read_model_shape(cfg.critic.model_path)
            lines.append(f"critic      {critic.source} (critic.model_path): {critic.describe()}")
        except ModelConfigError:
            lines.append(f"critic      critic.model_path={cfg.critic.model_path!r} is not here: planned with the "
                         "policy's shape")
    reward = None
    if cfg.reward.model_path:
        try:
            reward = read_model_shape(cfg.reward.model_path)
            lines.append(f"reward      {reward.source} (reward.model_path): {reward.describe()}")
        except ModelConfigError:
            lines.append(f"reward      reward.model_path={cfg.reward.model_path!r} is not here: NOT counted")
    return RoleShapes(policy=policy, critic=critic, reward_model=reward), lines


def host_memory(cfg: DictConfig) -> tuple[int | None, str]:
    """Memory of one node for a CPU plan: slurm.mem_per_node (Slurm's units: MiB by default, K/M/G/T
    suffixes 1024-based; 0 means the whole node, unknown here), else this machine's MemTotal for a
    one-node run (`hpcrl run` runs there)."""
    spec = cfg.slurm.mem_per_node
    if spec not in (None, "", "0"):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTkmgt]?)[Bb]?\s*", str(spec))
        if m:
            scale = {"": 1 << 20, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
            return int(float(m.group(1)) * scale), f"slurm.mem_per_node={spec}"
    if cfg.trainer.nnodes == 1:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024, "this machine's MemTotal"
        except OSError:
            pass
    return None, ""


# -- the table ------------------------------------------------------------------------------------
ROW_GROUPS = ("actor ", "critic ", "reference ", "reward model ", "vLLM ", "reshard ", "transfer ", "received ",
              "activations ", "working ", "gathered ", "logits ", "grad ")


def _row_rank(label: str) -> int:
    """Rows by role (actor, critic, reference, reward model), then vLLM, the transients, and the
    runtime last."""
    return next((i for i, prefix in enumerate(ROW_GROUPS) if label.startswith(prefix)), len(ROW_GROUPS))


def _cell(nbytes: int | None, unit: int) -> str:
    return "-" if not nbytes else f"{nbytes / unit:.2f}"


def format_estimate(est: Estimate) -> list[str]:
    """The table (rows: terms, columns: phases) with totals, the peak, the KV cache and notes."""
    unit, unit_name = (GIB, "GiB per GPU") if est.device == "gpu" else (GB, f"GB per {est.kind} process")
    short = _unit_name(est)
    where = f", pipeline stage {est.stage} of {est.pipeline_stages}" if est.pipeline_stages > 1 else ""
    labels: list[str] = []
    for phase in est.phases:
        labels += [k for k in phase.terms if k not in labels]
    labels.sort(key=_row_rank)  # stable: within a group, the order the phases add them
    width = max(len(x) for x in [*labels, unit_name + where]) + 2
    head = f"  {unit_name + where:<{width}}" + "".join(f"{COLUMN[p.name]:>11}" for p in est.phases)
    lines = [head]
    for label in labels:
        lines.append(f"  {label:<{width}}" + "".join(f"{_cell(p.terms.get(label), unit):>11}" for p in est.phases))
    lines.append(f"  {'total':<{width}}" + "".join(f"{p.total / unit:>11.2f}" for p in est.phases))
    meaning = {**PHASE_MEANING, **(fsdp.PHASE_MEANING if est.engine == fsdp.ENGINE else {})}
    lines.append("  (" + "; ".join(f"{COLUMN[p.name]}: {meaning[p.name]}" for p in est.phases) + ")")
    peak = est.peak
    if est.capacity_bytes:
        spare = est.capacity_bytes - peak.total
        lines.append(f"peak        {peak.name}: {peak.total / unit:.2f} {short} of {est.capacity_bytes / unit:.2f} "
                     f"{short} ({est.capacity_source}); {'spare' if spare >= 0 else 'over by'} "
                     f"{abs(spare) / unit:.2f} {short}")
    else:
        lines.append(f"peak        {peak.name}: {peak.total / unit:.2f} {short}")
    kv = est.kv
    if not any(ph.name == "rollout" for ph in est.phases):  # DPO: no rollout engine
        kv = None
    per_engine = f"a step gives each engine {kv.samples_per_engine} sample(s)" if kv else ""
    if kv is not None and kv.val_per_engine:
        per_engine += f", a validation batch {kv.val_per_engine}"
    if kv is not None:
        hold = kv.sequences
        lines.append(f"KV cache    {kv.nbytes / unit:.2f} {short} ({kv.rule}); {kv.bytes_per_token / 1024:.1f} KiB a "
                     f"token: {hold} sequence(s) of {kv.sequence_tokens} tokens at once "
                     f"({'holds at least one full sequence' if hold >= 1 else 'NOT one full sequence'}); {per_engine}"
                     + ("" if hold >= max(kv.samples_per_engine, kv.val_per_engine) or hold < 1
                        else " (vLLM queues the rest: slower, not out of memory)"))
    for what, nbytes in est.host_pinned_per_node.items():
        if nbytes:
            lines.append(f"host        {nbytes / GIB:.2f} GiB pinned host memory per node: {what}")
    for note in est.notes:
        lines.append(f"note        {note}")
    return lines


RECOMPUTE_MEANING = {
    "none": "no activation recompute (actor.recompute=none)",
    "selective": "selective recompute (actor.recompute=selective: the core attention re-run in the backward)",
    "full": "full recompute (actor.recompute=full: each layer's input kept, the layer re-run in the backward)",
}


def activation_line(est: Estimate) -> str:
    """How the actor's activations are laid out: micro-batch tokens (per CP rank), micro-batches in
    flight, sequence parallel, recompute."""
    lay = est.actor_layout
    tokens = f"micro-batches of {est.micro_batch_tokens} tokens (actor)"
    if lay is not None and lay.cp > 1:
        tokens += f", {est.micro_batch_tokens // lay.cp} on each rank (context parallel CP={lay.cp})"
    kept = (f"{est.micro_batches_in_flight} kept at once on stage {est.stage} (1F1B)" if est.pipeline_stages > 1
            else "one at a time (no pipeline)")
    sp = f"; sequence parallel: the norm regions split over TP={lay.tp}" if lay is not None and lay.sp else ""
    return f"{tokens}, {kept}{sp}; {RECOMPUTE_MEANING.get(est.recompute, est.recompute)}"


def _units(est: Estimate) -> tuple[int, str]:
    return (GIB, "GiB") if est.device == "gpu" else (GB, "GB")


def verdict_lines(est: Estimate, suggestions: list[str]) -> list[str]:
    """The verdict, with why it does not fit and what to change."""
    unit, short = (GIB if est.device == "gpu" else GB), _unit_name(est)
    fits = est.fits
    if fits is None:
        return ["verdict     not judged: no memory size to compare with (set slurm.mem_per_node, or plan on the "
                "machine that runs it)"]
    if fits:
        tight = est.capacity_bytes and est.peak.total > 0.95 * est.capacity_bytes
        return ["verdict     fits" + (" (less than 5% to spare: the allocator's fragmentation is not counted)"
                                      if tight else "")]
    why = list(est.problems)
    if est.capacity_bytes is not None and est.peak.total > est.capacity_bytes:
        why.insert(0, f"{est.peak.name} needs {est.peak.total / unit:.2f} {short} > "
                      f"{est.capacity_bytes / unit:.2f} {short} ({est.capacity_source})")
    lines = ["verdict     does not fit: " + why[0]] + [f"            and: {w}" for w in why[1:]]
    if suggestions:
        lines.append("what to change (planned again with each change):")
        lines += [f"  - {s}" for s in suggestions]
    return lines


def worker_span(first: int, last: int) -> str:
    """"worker 3" or "workers 3-4"."""
    return f"worker {first}" if first == last else f"workers {first}-{last}"


# -- measured vs estimated ------------------------------------------------------------------------
def compare_with_run(est: Estimate, run_dir: str | Path, ranks: Sequence[int] | None = None) -> list[str]:
    """The estimate next to what a run measured, step by step (metrics.jsonl: memory/rss_gb_max, the
    largest peak resident set over the workers; on GPU also memory/cuda_reserved_gb_max); with
    `ranks` (the MPI ranks of one kind of worker) the largest of those ranks' memory/rank<R>/ values.
    Raises FileNotFoundError when the run has no such metrics."""
    from hpcrl.trainer.metrics import read_metrics

    records = [r for r in read_metrics(run_dir) if "memory/rss_gb_max" in r]
    if not records:
        raise FileNotFoundError(f"{Path(run_dir) / 'metrics.jsonl'}: no step with memory/rss_gb_max")
    gpu = est.device == "gpu"
    key = "memory/cuda_reserved_gb_max" if gpu else "memory/rss_gb_max"
    estimate_gb = est.peak.total / GB
    in_gib = f" = {est.peak.total / GIB:.2f} GiB" if gpu else ""
    over = "" if ranks is None else f", {est.kind}s: {worker_span(min(ranks), max(ranks))}"
    lines = [f"measured vs estimated ({key}{over}, GB = 1e9 bytes; estimate: peak phase {est.peak.name} "
             f"{estimate_gb:.2f} GB{in_gib})"]
    ratios = []
    for r in records:
        if ranks is not None:
            per_rank = key.replace("memory/", "memory/rank{}/").removesuffix("_max")
            values = [float(r[per_rank.format(k)]) for k in ranks if per_rank.format(k) in r]
            r = {**r, key: max(values)} if values else {k: v for k, v in r.items() if k != key}
        if key not in r:
            continue
        measured = float(r[key])
        ratios.append((int(r.get("step", 0)), measured / estimate_gb))
        lines.append(f"  step {int(r.get('step', 0)):>4}: measured {measured:.2f} GB, estimated {estimate_gb:.2f} GB, "
                     f"measured / estimated {measured / estimate_gb:.2f}")
    steady = [x for s, x in ratios if s >= 2] or [x for _, x in ratios]
    if steady:
        steady.sort()
        lines.append(f"  median measured / estimated over steps >= 2: {steady[len(steady) // 2]:.2f}")
    return lines


# -- the command ----------------------------------------------------------------------------------
def _inputs(cfg: DictConfig, args: argparse.Namespace) -> _Inputs:
    """Raises ModelConfigError when the policy's config.json cannot be read."""
    shapes, model_lines = read_shapes(cfg, getattr(args, "model_config", None))
    asked = getattr(args, "gpu_mem", None)
    device = plan_device(cfg, gpu_asked=asked is not None or getattr(args, "gpus_per_node", None) is not None)
    gpu_mem, note = None, ""
    if device == "gpu":
        gpu_mem = int((asked if asked is not None else 80.0) * GIB)
        note = "" if asked is not None else " (assumed: pass --gpu-mem)"
    host = host_memory(cfg) if device == "cpu" else (None, "")
    return _Inputs(shapes, model_lines, device, gpu_mem, note, host)


def _read_inputs(cfg: DictConfig, args: argparse.Namespace) -> _Inputs | int:
    """The inputs, or the exit status after saying why there are none: an unreadable --model-config
    is an invalid argument; a model.path that is not here only means no memory plan (as with
    --skip-path-checks, the layouts were still planned)."""
    try:
        return _inputs(cfg, args)
    except ModelConfigError as e:
        if getattr(args, "model_config", None):
            print(f"hpcrl plan: --model-config: {e}", file=sys.stderr)
            return EXIT_INVALID
        print("\nmemory      not planned: the model's config.json is not here (pass --model-config PATH; stderr says "
              "more)")
        print(f"hpcrl plan: no memory plan: {e}", file=sys.stderr)
        return EXIT_FITS


def memory_plan(cfg: DictConfig, args: argparse.Namespace, change: ClusterChange) -> int:
    """Print the memory plan of a validated config (after the layouts `hpcrl plan` prints); the
    exit status."""
    inputs = _read_inputs(cfg, args)
    if isinstance(inputs, int):
        return inputs
    shapes, model_lines, device = inputs.shapes, inputs.model_lines, inputs.device
    gpu_mem, gpu_mem_note, host = inputs.gpu_mem, inputs.gpu_mem_note, inputs.host
    est = estimate(cfg, shapes, gpu_mem, host[0], host[1])
    # the split placement's two kinds of worker, each planned with the MPI ranks it runs on
    t, w = trainer_world_size(cfg), world_size(cfg)
    kinds: list[tuple[Estimate, Planner, range | None]] = [(est, estimate, None)]
    if is_split(cfg):
        kinds = [(est, estimate, range(1, t + 1)),
                 (estimate_rollout_worker(cfg, shapes, gpu_mem, host[0], host[1]), estimate_rollout_worker,
                  range(t + 1, w + 1))]
    print()
    if device == "gpu":
        print(f"memory plan (docs/planner.md): {cfg.trainer.nnodes} node(s) x {cfg.trainer.workers_per_node} GPU(s) "
              f"= {w} workers, {gpu_mem / GIB:g} GiB per GPU{gpu_mem_note}")
    else:
        print(f"memory plan (docs/planner.md): {cfg.trainer.nnodes} node(s) x {cfg.trainer.workers_per_node} CPU "
              f"worker process(es) = {w} workers")
    for note in change.notes:
        print(f"note        {note}")
    for line in model_lines:
        print(line)
    lay = role_layouts(cfg)["actor"]
    # the engine cuts them over the DP x CP replicas (CP ranks hold the same weights)
    over = f"{lay.dp} DP" if lay.cp == 1 else f"{lay.dp} DP x {lay.cp} CP"
    precision = (f"{est.dtype} weights" + ("; fp32 master weights and fp32 gradient buffers" if est.dtype == "bf16"
                                           else "; fp32 gradients while updating") + "; Adam moments 2 x fp32"
                 + (f"; masters and moments cut over the actor's {over} ranks (actor.optim.shard_over_dp)"
                    if cfg.actor.optim.shard_over_dp and lay.dp * lay.cp > 1 else ""))
    if not fsdp.on_fsdp(cfg, "actor"):
        print(f"precision   {precision}")
    if fsdp.ENGINE in engine_roles(cfg).values():
        print(f"precision   {fsdp.precision_line(cfg, est.dtype, est.device)}")
    print(f"activations {fsdp.activation_line(est, cfg) if est.engine == fsdp.ENGINE else activation_line(est)}")
    if shapes.policy.is_moe and est.engine != fsdp.ENGINE:
        print(f"experts     {experts_line(cfg, shapes.policy, est, *_units(est))}")
    status = EXIT_FITS
    for kind_est, planner, ranks in kinds:
        if ranks is not None:
            print(f"\n{kind_est.kind}s: {worker_span(ranks.start, ranks.stop - 1)} (MPI ranks; the controller is 0)")
        for line in format_estimate(kind_est):
            print(line)
        suggestions = suggest(cfg, kind_est, shapes, gpu_mem, host, planner) if kind_est.fits is False else []
        for line in verdict_lines(kind_est, suggestions):
            print(line)
        if kind_est.fits is False:
            status = EXIT_DOES_NOT_FIT
    if getattr(args, "compare", None):
        try:
            for kind_est, _, ranks in kinds:
                for line in compare_with_run(kind_est, args.compare, ranks):
                    print(line)
        except FileNotFoundError as e:
            print(f"hpcrl plan: --compare: {e}", file=sys.stderr)
            return EXIT_NO_METRICS
    return status
