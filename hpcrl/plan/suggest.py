"""What to change when a run does not fit: `hpcrl plan` plans the config again with some keys changed
and keeps what fits (the "what to change" lines report.py prints under the verdict).

- `suggest`: the first change of each kind that fits alone (a larger EP for an MoE model, a larger
  TP x PP, sequence parallel, context parallel, recompute, smaller micro-batches, actor.offload, a
  smaller vLLM share or KV cache, shorter completions); when none does alone, the smallest
  combination that does; else the closest tries.
- `placeable_layouts`, `best_placeable`: when the config's layout cannot be placed on the workers
  --nodes / --gpus-per-node give, the largest (TP, PP) layouts that can, planned (ClusterChange.refuse).
- `_try` plans one set of changes (None when the config they make does not validate);
  `_with_valid_budgets` adds what a layout change needs to validate (sequence parallel, micro-batch
  budgets a multiple of the row length multiple); `_describe_try` writes a try as KEY=VALUE overrides
  with its peak and verdict.

Each try is planned by a `Planner` of memory.py (`estimate`, or `estimate_rollout_worker` for the
split placement's rollout workers) with the `_Inputs` the command read (the models' shapes, the
memory to compare with); the recompute modes tried are activations.RECOMPUTE_MODES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hpcrl.config import ConfigError, critic_enabled, reference_enabled, role_layouts, validate, world_size
from hpcrl.config.derived import token_multiple, trainer_world_size
from hpcrl.plan import fsdp
from hpcrl.plan.activations import GB, GIB, RECOMPUTE_MODES
from hpcrl.plan.memory import Estimate, RoleShapes, estimate
from hpcrl.plan.moe import expert_parallel, expert_parallel_choices
from hpcrl.plan.shape import ModelShape

# estimate or estimate_rollout_worker: (cfg, shapes, gpu_mem_bytes, host_mem_bytes, host_mem_source)
Planner = Callable[..., Estimate]


@dataclass
class _Inputs:
    """What a plan needs besides the config: the models' shapes and the memory to compare with."""

    shapes: RoleShapes
    model_lines: list[str]
    device: str
    gpu_mem: int | None
    gpu_mem_note: str
    host: tuple[int | None, str]


def _unit_name(est: Estimate) -> str:
    return "GiB" if est.device == "gpu" else "GB"


# -- what to change -------------------------------------------------------------------------------
def _try(cfg: DictConfig, changes: dict[str, Any], shapes: RoleShapes, gpu_mem: int | None,
         host: tuple[int | None, str], planner: Planner = estimate) -> Estimate | None:
    """The plan (of the worker kind `planner` plans) with some keys changed, or None when that config
    is not valid."""
    cand = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key, value in changes.items():
        OmegaConf.update(cand, key, value, merge=False)
    try:
        validate(cand)
    except ConfigError:
        return None
    return planner(cand, shapes, gpu_mem, host[0], host[1])


def _yaml_value(value: Any) -> str:
    """A value as a KEY=VALUE override writes it (YAML: null, true, false)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _describe_try(changes: dict[str, Any], est: Estimate) -> str:
    unit = GIB if est.device == "gpu" else GB
    keys = " ".join(f"{k}={_yaml_value(v)}" for k, v in changes.items())
    return (f"{keys}: peak {est.peak.total / unit:.2f} {_unit_name(est)} ({est.peak.name}), "
            + ("fits" if est.fits else "does not fit" + (f" ({est.problems[0]})" if est.problems else "")))


def _own_parallel_roles(cfg: DictConfig) -> list[str]:
    """The enabled roles besides the actor whose `parallel` section is set (the others follow the
    actor's)."""
    return [role for role in ("critic", "reference")
            if cfg[role].parallel is not None and (critic_enabled(cfg) if role == "critic" else reference_enabled(cfg))]


def _parallel_changes(cfg: DictConfig, sizes: dict[str, Any], moves_dp: bool = True) -> dict[str, Any]:
    """Keys that set `sizes` ({"tensor_parallel": ..., "context_parallel": ...}) on every Megatron
    role (colocated roles share one layout); when they change DP (`moves_dp`), the data_parallel
    cross-checks they would break set to null."""
    changes: dict[str, Any] = {f"actor.parallel.{k}": v for k, v in sizes.items()}
    if moves_dp and cfg.actor.parallel.data_parallel is not None:
        changes["actor.parallel.data_parallel"] = None
    for role in _own_parallel_roles(cfg):
        changes.update({f"{role}.parallel.{k}": v for k, v in sizes.items()})
        if moves_dp and cfg[role].parallel.data_parallel is not None:
            changes[f"{role}.parallel.data_parallel"] = None
    return changes


def _layout_changes(cfg: DictConfig, tp: int, pp: int) -> dict[str, Any]:
    """Keys that move every Megatron role to TP x PP (colocated roles share one layout)."""
    return _parallel_changes(cfg, {"tensor_parallel": tp, "pipeline_parallel": pp})


def _cp_changes(cfg: DictConfig, cp: int) -> dict[str, Any]:
    """Keys that move every Megatron role to context parallel `cp`; the dense attention cannot take
    it (validate.py), so it moves to the per-sequence one."""
    changes = _parallel_changes(cfg, {"context_parallel": cp})
    if cp > 1 and cfg.model.local_attention == "dense":
        changes["model.local_attention"] = "per_sequence"
    return changes


def _recompute_changes(cfg: DictConfig, mode: str) -> dict[str, Any]:
    """actor.recompute (and the critic's, when there is one) set to `mode`."""
    return {"actor.recompute": mode, **({"critic.recompute": mode} if critic_enabled(cfg) else {})}


def _with_valid_budgets(cfg: DictConfig, changes: dict[str, Any], moe: bool = False) -> dict[str, Any]:
    """`changes` plus what the layout they make needs to validate: sequence parallel off where TP
    becomes 1 (on wherever an MoE model's TP is more: `moe`; megatron trains MoE layers under TP only
    with it), and the packing budgets moved up to a multiple of the new row length multiple
    (`token_multiple`)."""
    out = dict(changes)

    def value(key: str) -> Any:
        return out[key] if key in out else OmegaConf.select(cfg, key)

    for role in ["actor", *_own_parallel_roles(cfg)]:
        sp, tp = value(f"{role}.parallel.sequence_parallel"), value(f"{role}.parallel.tensor_parallel")
        if sp and tp == 1 or moe and not sp and tp > 1:
            out[f"{role}.parallel.sequence_parallel"] = not sp
    for role in ["actor"] + (["critic"] if critic_enabled(cfg) else []):
        par = f"{role}.parallel" if role == "actor" or cfg[role].parallel is not None else "actor.parallel"
        multiple = token_multiple(value(f"{par}.tensor_parallel"), value(f"{par}.context_parallel"),
                                  bool(value(f"{par}.sequence_parallel")))
        budget = value(f"{role}.micro_batch_tokens")
        if cfg[role].packing and budget % multiple:
            out[f"{role}.micro_batch_tokens"] = -(-budget // multiple) * multiple
    return out


def _token_ladder(start: int, floor: int) -> list[int]:
    """Micro-batch budgets to try below `start`: halving, down to one full sequence (`floor`), below
    which a budget changes nothing (a longer sequence gets a micro-batch of its own)."""
    out = []
    tokens = start // 2
    while tokens > floor:
        out.append(tokens)
        tokens //= 2
    if floor < start:
        out.append(floor)
    return out


def suggest(cfg: DictConfig, est: Estimate, shapes: RoleShapes, gpu_mem: int | None,
            host: tuple[int | None, str], planner: Planner = estimate) -> list[str]:
    """Changes that make the plan fit, found by planning again: the first of each kind that fits
    alone (a larger TP x PP, smaller micro-batches, actor.offload, a smaller vLLM share or KV cache,
    shorter completions); when none does alone, the smallest combination of layout and micro-batch
    budget that does, and otherwise the closest tries."""
    tried: list[tuple[dict[str, Any], Estimate, str]] = []

    shape = shapes.policy

    def attempt(changes: dict[str, Any], kind: str) -> Estimate | None:
        changes = _with_valid_budgets(cfg, changes, moe=shape.is_moe)
        if any(changes == c for c, _, _ in tried):
            return next(r for c, r, _ in tried if c == changes)
        result = _try(cfg, changes, shapes, gpu_mem, host, planner)
        if result is not None:
            tried.append((changes, result, kind))
        return result

    par = cfg.actor.parallel
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    w = trainer_world_size(cfg)
    # an MoE model's experts over more of the DP x CP ranks: the smallest EP that fits
    lay = role_layouts(cfg)["actor"]
    eps = expert_parallel_choices(shape, lay, expert_parallel(cfg, "actor", lay)) if shape.is_moe else []
    for ep in eps:
        r = attempt(_parallel_changes(cfg, {"expert_parallel": ep}, moves_dp=False), "expert parallel")
        if r is not None and r.fits:
            break
    # a larger TP x PP: weights, gradients and Adam states per GPU shrink with it
    layouts = [(tp, p) for p in range(pp + 1, shape.num_layers + 1)
               if shape.num_layers % p == 0 and w % (tp * p * cp) == 0]
    layouts += [(t, pp) for t in range(tp + 1, cfg.trainer.workers_per_node + 1)
                if shape.num_heads % t == 0 and shape.num_kv_heads % t == 0 and w % (t * pp * cp) == 0]
    for new_tp, new_pp in layouts:
        r = attempt(_layout_changes(cfg, new_tp, new_pp), "layout")
        if r is not None and r.fits:
            break
    # sequence parallel: the norm regions' activations split over TP (a reduce-scatter and an all-gather
    # in place of each all-reduce: the same volume)
    sp_on = _parallel_changes(cfg, {"sequence_parallel": True}, moves_dp=False) \
        if tp > 1 and not par.sequence_parallel else {}
    if sp_on:
        attempt(sp_on, "sequence parallel")
    # context parallel: each rank holds 1 / CP of every sequence, and 1 / CP of its activations; the
    # smallest CP that fits, alone or else with sequence parallel (a larger CP leaves fewer DP ranks
    # to cut the optimizer state over, so it can cost more than it saves)
    cps = [c for c in (2, 4, 8) if c > cp and w % (tp * pp * c) == 0]
    for companion in ([{}, sp_on] if sp_on else [{}]):
        r = None
        for c in cps:
            r = attempt({**_cp_changes(cfg, c), **companion}, "context parallel")
            if r is not None and r.fits:
                break
        if r is not None and r.fits:
            break
    # activation recompute: the backward re-runs the core attention (selective) or each layer (full)
    current = cfg.actor.recompute if cfg.actor.recompute in RECOMPUTE_MODES else "none"
    modes = list(RECOMPUTE_MODES[RECOMPUTE_MODES.index(current) + 1:])
    for mode in modes:
        r = attempt(_recompute_changes(cfg, mode), "recompute")
        if r is not None and r.fits:
            break

    def token_changes(tokens: int) -> dict[str, Any]:
        changes: dict[str, Any] = {"actor.micro_batch_tokens": tokens}
        if critic_enabled(cfg):
            changes["critic.micro_batch_tokens"] = min(tokens, cfg.critic.micro_batch_tokens)
        return changes

    # smaller micro-batches: the activations shrink with them
    ladder = _token_ladder(cfg.actor.micro_batch_tokens, est.kv.sequence_tokens)
    for tokens in ladder:
        r = attempt(token_changes(tokens), "micro-batch")
        if r is not None and r.fits:
            break
    on_fsdp = fsdp.on_fsdp(cfg, "actor")
    if est.device == "gpu" and not cfg.actor.offload and not on_fsdp:
        attempt({"actor.offload": True}, "offload")
    for changes, kind in fsdp.suggestions(cfg, est.device):  # the FSDP engine's own keys
        attempt(changes, kind)
    if est.device == "gpu":
        util = round(cfg.rollout.gpu_memory_utilization - 0.05, 2)
        while util >= 0.05:
            r = attempt({"rollout.gpu_memory_utilization": util}, "vLLM share")
            if r is not None and r.fits:
                break
            util = round(util - 0.05, 2)
    elif est.kv.nbytes > GIB // 4:
        attempt({"rollout.cpu_kv_cache_gib": round(est.kv.nbytes / GIB / 2, 3)}, "vLLM share")
    if est.kv.sequences < 1:
        new = cfg.rollout.max_new_tokens // 2
        while new >= 16:
            r = attempt({"rollout.max_new_tokens": new}, "completions")
            if r is not None and r.fits:
                break
            new //= 2
    out: list[str] = []
    seen: set[str] = set()
    for changes, r, kind in tried:
        if r.fits and kind not in seen:
            seen.add(kind)
            out.append(_describe_try(changes, r))
    if out:
        return out
    # nothing alone: the smallest CP with the cheapest recompute (and sequence parallel) that fits,
    # with the actor offloaded while vLLM generates when that is what it takes (GPU)
    offload_key = "actor.fsdp.cpu_offload" if on_fsdp else "actor.offload"
    offload = [{offload_key: True}] if est.device == "gpu" and not OmegaConf.select(cfg, offload_key) else []
    most_ep = [_parallel_changes(cfg, {"expert_parallel": eps[-1]}, moves_dp=False)] if eps else []
    # the FSDP engine's reshard_after_forward=true, alone and with its offload (none on Megatron)
    fixes = [c for c, _ in fsdp.suggestions(cfg, est.device) if offload_key not in c]
    for extra in [{}, *most_ep, *offload, *[{**e, **o} for e in most_ep for o in offload],
                  *fixes, *[{**f, **o} for f in fixes for o in offload]]:
        for c in [cp] + cps:
            for mode in [current] + modes:
                changes = {**sp_on, **(_cp_changes(cfg, c) if c != cp else {}),
                           **(_recompute_changes(cfg, mode) if mode != current else {}), **extra}
                r = attempt(changes, "long sequences") if changes else None
                if r is not None and r.fits:
                    return [_describe_try(_with_valid_budgets(cfg, changes, shape.is_moe), r)
                            + " (no single change fits)"]
    # then the smallest layout change that fits with the largest micro-batch budget
    for new_tp, new_pp in [(tp, pp)] + layouts:
        for tokens in ladder:
            changes = {**(_layout_changes(cfg, new_tp, new_pp) if (new_tp, new_pp) != (tp, pp) else {}),
                       **token_changes(tokens)}
            r = attempt(changes, "layout and micro-batch")
            if r is not None and r.fits:
                return [_describe_try(_with_valid_budgets(cfg, changes, shape.is_moe), r)
                        + " (no single change fits)"]
    closest = sorted(tried, key=lambda crk: crk[1].peak.total)[:3]
    if on_fsdp:
        return [_describe_try(c, r) for c, r, _ in closest] + [
            "nothing tried fits: use GPUs with more memory, more nodes (the FSDP engine cuts weights, gradients and "
            "optimizer state over every DP rank; a rank's activations, gathered units and logits, and the whole fp32 "
            "model it loads at start-up, do not shrink with DP), or actor.engine=megatron (TP x PP cut the layers)"]
    return [_describe_try(c, r) for c, r, _ in closest] + [
        "nothing tried fits: use GPUs with more memory, or more nodes with a larger TP x PP x CP; more nodes alone "
        "do not help (per-GPU memory does not depend on DP beyond the optimizer state actor.optim.shard_over_dp "
        "cuts over it" + ("; for an MoE model they leave room for a larger actor.parallel.expert_parallel, "
                          "fewer experts a GPU)" if shape.is_moe else ")")]


# -- layouts that can be placed (--nodes / --gpus-per-node) ----------------------------------------
def placeable_layouts(cfg: DictConfig, shape: ModelShape) -> list[tuple[int, int]]:
    """(TP, PP) layouts a Megatron role can take on the config's workers: TP within a node and
    dividing the heads and KV heads, PP dividing the layers, TP x PP x CP (the config's CP) dividing
    the workers; the largest TP x PP first (the least memory per GPU)."""
    w, cp = world_size(cfg), cfg.actor.parallel.context_parallel
    out = [(t, p) for t in range(1, cfg.trainer.workers_per_node + 1) for p in range(1, shape.num_layers + 1)
           if shape.num_heads % t == 0 and shape.num_kv_heads % t == 0 and shape.num_layers % p == 0
           and w % (t * p * cp) == 0]
    return sorted(out, key=lambda tp_pp: (-tp_pp[0] * tp_pp[1], -tp_pp[0]))


def best_placeable(cfg: DictConfig, inputs: _Inputs) -> str | None:
    """On a world where the config's layout cannot be placed: the plan of the largest layouts that
    can (with smaller micro-batches when that is what it takes), one line."""
    layouts = placeable_layouts(cfg, inputs.shapes.policy)[:3]
    if not layouts:
        return None
    ladder = [cfg.actor.micro_batch_tokens] + _token_ladder(cfg.actor.micro_batch_tokens,
                                                            cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    best: tuple[dict[str, Any], Estimate] | None = None
    for tp, pp in layouts:
        for tokens in ladder:
            changes = {**_layout_changes(cfg, tp, pp), "actor.micro_batch_tokens": tokens}
            if critic_enabled(cfg):
                changes["critic.micro_batch_tokens"] = min(tokens, cfg.critic.micro_batch_tokens)
            changes = _with_valid_budgets(cfg, changes, inputs.shapes.policy.is_moe)
            r = _try(cfg, changes, inputs.shapes, inputs.gpu_mem, inputs.host)
            if r is None:
                continue
            if r.fits:
                return "the largest layouts that do place, planned: " + _describe_try(changes, r)
            if best is None or r.peak.total < best[1].peak.total:
                best = (changes, r)
    return None if best is None else "the largest layouts that do place, planned: " + _describe_try(*best)
