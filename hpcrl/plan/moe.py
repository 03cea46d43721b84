"""Mixture of experts in the memory plan: what the experts of an MoE model (Qwen3-MoE: every layer's
MLP is E experts and a router, top k experts a token) put on one GPU, by term (docs/planner.md,
"Mixture of experts").

The layout is megatron-core's, as hpcrl.engines.megatron.moe sets it: expert parallel (EP) ranks
carved out of a role's DP x CP ranks, expert tensor parallel = TP, the all-to-all token dispatcher.

- `expert_parallel`: a role's EP (`{role}.parallel.expert_parallel`, 1 when not set).
- `expert_shard_params`, `role_shard_params`: a stage's parameters on one GPU, split into what every
  DP x CP rank holds (attention, norms, routers, embedding, head) and the experts: E / EP experts of
  every MoE layer, each TP-sharded as a dense MLP is.
- `expert_data_parallel`: the ranks that hold the same experts (DP x CP / EP); with
  optim.shard_over_dp (ZeRO-1) the experts' fp32 masters and Adam moments are cut over them, the rest
  over all DP x CP ranks (`megatron.MegatronRoleShard.experts`).
- `kept_elements_per_token`, `working_elements_per_token`, `kept_dispatch_bytes`: the dispatcher's
  buffers (the tokens x top-k permuted hidden states into and out of the experts) and the experts'
  activations, kept for the backward and alive inside one layer.
- `layout_problems`, `expert_parallel_choices`: what megatron refuses, and the EPs `hpcrl plan`
  tries when a run does not fit (suggest.suggest).
- `experts_line`: the plan's `experts` line (EP layout, expert state per GPU, dispatcher buffers).

Arithmetic only (no torch): the plan imports this with memory.py.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from hpcrl.config.derived import Layout, role_parallel
from hpcrl.plan.shape import ModelShape, megatron_shard_params

# hpcrl.plan.memory's Estimate and hpcrl.plan.activations' LayerActivations (both import this module,
# not the reverse)
Estimate = Any
LayerActivations = Any

# the table's row of the MoE layers' kept activations (the update phases)
DISPATCH_LABEL = "activations kept: MoE dispatch + experts"


def expert_parallel(cfg: DictConfig, role: str, lay: Layout | None = None) -> int:
    """EP of a Megatron role: its layout's, else its `parallel` block's expert_parallel (the
    actor's when the role has none), else 1. The reward model runs in the actor's layout."""
    ep = getattr(lay, "ep", None)
    if ep is None:
        par = role_parallel(cfg, role if role in ("actor", "critic", "reference") else "actor")
        ep = par.get("expert_parallel", 1) if par is not None else 1
    return max(int(ep or 1), 1)


def expert_shard_params(shape: ModelShape, tp: int, ep: int, pp: int) -> int:
    """Expert parameters on one GPU of a pipeline stage: L / PP layers of E / EP experts, each expert's
    gate, up and down projections split over TP (3 h I_moe / TP)."""
    return (shape.num_layers // pp) * shape.expert_shard_layer_params(tp, ep)


def role_shard_params(shape: ModelShape, tp: int, pp: int, stage: int, head: str, ep: int) -> tuple[int, int]:
    """(the rest, the experts) of what one GPU of `stage` holds (`megatron_shard_params`): the rest is
    on every DP x CP rank alike, the experts differ from EP rank to EP rank."""
    experts = expert_shard_params(shape, tp, ep, pp)
    return megatron_shard_params(shape, tp, pp, stage, head, ep=ep) - experts, experts


def expert_data_parallel(lay: Layout, ep: int) -> int:
    """The ranks that hold the same experts (megatron's expert data parallel group): DP x CP / EP."""
    return max(lay.dp * lay.cp // max(ep, 1), 1)


def dispatch_elements_per_token(shape: ModelShape) -> float:
    """The all-to-all dispatcher's buffers per token of the rank: its hidden states permuted, one
    row per chosen expert, as they go into the experts and as they come out (2 k h). The rank's
    tokens after the dispatcher's all-gather over TP: a rank's share of the micro-batch (1 / CP of it),
    with routing assumed even over the experts (dropless: an expert that gets more tokens keeps more)."""
    return 2 * shape.num_experts_per_tok * shape.hidden_size if shape.is_moe else 0.0


def expert_activation_elements_per_token(shape: ModelShape, tp: int, fused_swiglu: bool) -> float:
    """The experts' activations kept for the backward per token of the rank: for each of its k
    experts the fc1 output [gate, up] (2 I_moe / TP) and the down projection's input (I_moe / TP), and
    the SiLU output (I_moe / TP) when the gate is not fused, as for a dense MLP."""
    if not shape.is_moe:
        return 0.0
    return shape.num_experts_per_tok * (3 if fused_swiglu else 4) * shape.moe_intermediate_size / tp


def kept_elements_per_token(shape: ModelShape, tp: int, fused_swiglu: bool) -> float:
    """What an MoE layer keeps for its backward per token in place of a dense MLP's activations: the
    dispatcher's buffers and the experts' activations (0 for a dense model)."""
    return dispatch_elements_per_token(shape) + expert_activation_elements_per_token(shape, tp, fused_swiglu)


def working_elements_per_token(shape: ModelShape, tp: int) -> float:
    """An MoE layer's transient elements per token in place of a dense MLP's 3 I / TP: the permuted
    hidden states sent and received by the all-to-all (2 k h) and the experts' projection and
    activation outputs (3 k I_moe / TP)."""
    k = shape.num_experts_per_tok
    return k * (2 * shape.hidden_size + 3 * shape.moe_intermediate_size / tp)


def kept_dispatch_bytes(acts: LayerActivations, layers: int, in_flight: int, recompute: str) -> int:
    """The MoE share of `kept_activation_bytes`: every layer's dispatcher buffers and experts'
    activations of the micro-batches in flight; with full recompute only those of the one layer the
    backward re-runs (a layer keeps its input alone)."""
    return acts.moe if recompute == "full" else in_flight * layers * acts.moe


def layout_problems(cfg: DictConfig, shapes: dict[str, ModelShape], layouts: dict[str, Layout]) -> list[str]:
    """What megatron refuses of the MoE roles' layouts: EP must divide the experts (each EP rank holds
    E / EP whole experts) and the role's DP x CP; a trained MoE role at TP > 1 needs sequence parallel
    (megatron-core 0.16's MoELayer.forward raises in training without it). `shapes`: role -> its
    model's shape."""
    problems: list[str] = []
    for role, lay in layouts.items():
        shape = shapes.get(role)
        if shape is None or not shape.is_moe or (role != "actor" and cfg[role].parallel is None):
            continue  # dense, or the actor's parallel block (checked with the actor)
        where, ep = f"{role}.parallel", expert_parallel(cfg, role, lay)
        if shape.num_experts % ep or (lay.dp * lay.cp) % ep:
            choices = ", ".join(str(e) for e in expert_parallel_choices(shape, lay, 0))
            problems.append(f"{where}.expert_parallel={ep}: must divide the model's {shape.num_experts} experts and "
                            f"the {role}'s DP x CP = {lay.dp * lay.cp}: expert_parallel in {{{choices}}}")
        if role in ("actor", "critic") and lay.tp > 1 and not lay.sp:
            problems.append(f"{where}.tensor_parallel={lay.tp} on an MoE model needs {where}.sequence_parallel=true "
                            "(megatron-core refuses to train MoE layers under TP without it)")
    return problems


def expert_parallel_choices(shape: ModelShape, lay: Layout, above: int) -> list[int]:
    """The EPs larger than `above` that a role of layout `lay` can take: the divisors of its DP x CP
    that divide the experts, smallest first (the least all-to-all traffic)."""
    room = lay.dp * lay.cp
    return [e for e in range(above + 1, room + 1) if room % e == 0 and shape.num_experts % e == 0]


def experts_line(cfg: DictConfig, shape: ModelShape, est: Estimate, unit: int, unit_name: str) -> str:
    """The plan's `experts` line for an MoE policy: the actor's EP layout, its expert state on one
    GPU (the worst stage's, from the estimate's rows) and the dispatcher's kept buffers."""
    lay = est.actor_layout or Layout(1, 1, 1)
    ep = expert_parallel(cfg, "actor", lay)
    update = next((p for p in est.phases if p.name == "update actor"), None)
    terms = update.terms if update is not None else {}
    state = sum(v for k, v in terms.items() if k.startswith("actor expert "))
    edp = expert_data_parallel(lay, ep)
    if edp == 1:
        cut = "no other rank holds the same experts (DP x CP / EP = 1)"
    elif cfg.actor.optim.shard_over_dp and ep == 1:
        cut = f"their optimizer state cut over the {edp} expert-DP ranks (DP x CP / EP)"
    elif cfg.actor.optim.shard_over_dp:
        cut = f"the {edp} expert-DP ranks (DP x CP / EP) each keep all their optimizer state (no ZeRO-1 with EP)"
    else:
        cut = f"the {edp} expert-DP ranks (DP x CP / EP) each keep all their optimizer state"
    line = (f"EP={ep}: {shape.num_experts // ep} experts a rank (of {shape.num_experts}, "
            f"top-{shape.num_experts_per_tok} a token), each split over TP={lay.tp}; {cut}; expert weights, "
            f"gradients and optimizer state {state / unit:.2f} {unit_name} a rank")
    dispatch = terms.get(DISPATCH_LABEL)
    if dispatch:
        line += (f"; all-to-all dispatcher buffers and experts' activations {dispatch / unit:.2f} {unit_name} kept "
                 "for the backward")
    return line

