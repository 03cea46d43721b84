"""Mixture-of-experts in the Megatron engine: megatron's MoE settings for a Qwen3-MoE model, the
router's loss terms at hpcrl's loss scale, and the routing statistics a step logs.

  moe_config_kwargs   TransformerConfig fields of an MoE model (router, dispatcher, EP, loss terms)
  MoeSettings         what a role configures: load-balancing and z-loss coefficients
  RoutingStats        per-layer routing counts, router entropy and load-balancing loss of one step,
                      read from the routers' logits (hooks), reduced over the ranks that route

Layout: megatron's SequentialMLP experts on the local spec (TE's grouped GEMM on GPU is not used:
the experts stay plain column/row-parallel linears, converted like a dense MLP), expert tensor
parallel = TP (megatron's default), the expert-parallel ranks carved from DP x CP, and the
all-to-all token dispatcher (gloo on CPU, NCCL on GPU). Router: softmax over the top-k logits when
the model renormalises its top-k weights (Qwen3-MoE's norm_topk_prob), else softmax then top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class ModelArch(Protocol):
    """What this module reads of hpcrl.engines.megatron.model.ModelArch (which imports this module)."""

    architecture: str
    num_experts: int
    moe_ffn_hidden_size: int
    moe_topk: int
    norm_topk_prob: bool

    @property
    def is_moe(self) -> bool: ...


@dataclass(frozen=True)
class MoeSettings:
    """The router's loss terms of one trained role (0: off). Each is weighted like the policy loss:
    a mini-batch's term is the token-weighted mean of its micro-batches' terms (`loss_weight_of`)."""

    aux_loss_coeff: float = 0.0  # switch-style load-balancing loss (megatron's moe_aux_loss_coeff)
    z_loss_coeff: float = 0.0  # router z-loss (megatron's moe_z_loss_coeff)
    # the routers take given experts when the engine's `routes` are set (hpcrl.engines.megatron.routing_replay)
    routing_replay: bool = False


def moe_config_kwargs(arch: ModelArch, moe: MoeSettings | None, tp: int, ep: int) -> dict[str, Any]:
    """TransformerConfig fields for `arch` (none for a dense model)."""
    if not arch.is_moe:
        if ep > 1:
            raise ValueError(f"expert parallel {ep} needs a mixture-of-experts model; {arch.architecture} is dense")
        return {}
    if arch.num_experts % ep:
        raise ValueError(f"expert parallel {ep} does not divide the model's {arch.num_experts} experts")
    moe = moe or MoeSettings()
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_topk,
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss" if moe.aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": tp,
        "moe_enable_routing_replay": moe.routing_replay,
    }


def set_micro_batch_loss_scale(model: torch.nn.Module, moe: MoeSettings, share: float, tokens: int) -> None:
    """Scale this micro-batch's router loss terms to hpcrl's loss normalisation.

    hpcrl's token weights are normalised over the whole mini-batch and gradients are summed over
    micro-batches and DP ranks; megatron (calculate_per_token_loss, which expects a later division
    of every gradient by the step's token count) adds each micro-batch's load-balancing loss and
    z-loss times the rank's tokens in it. With the coefficients scaled by the micro-batch's share of
    the mini-batch's loss weight over those tokens, the step's terms are the weighted means of the
    micro-batches' terms, at the configured coefficients."""
    config = model.config
    if moe.aux_loss_coeff > 0:
        config.moe_aux_loss_coeff = moe.aux_loss_coeff * share / max(tokens, 1)
    if moe.z_loss_coeff > 0:
        config.moe_z_loss_coeff = moe.z_loss_coeff * share / max(tokens, 1)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of this pipeline stage, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def own_router_replays(model: torch.nn.Module) -> None:
    """megatron keeps every router's replay state in a process-wide list as well (for its global
    setters, which hpcrl does not use: a worker can hold several models); drop this model's from it,
    so that a closed engine's routers are not kept alive."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(r.router_replay) for r in routers(model) if r.router_replay is not None}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


class RoutingStats:
    """Routing of the forwards run while it is attached: per layer of this stage, the tokens each
    expert got, the router's entropy sum and the load-balancing loss's sums (Switch Transformer:
    E * sum_e f_e P_e, f_e the share of routed slots, P_e the mean router probability).

    Hooks read the router's logits; the top-k is recomputed from them (megatron's score function).
    `reduce` sums over the ranks that routed different tokens: DP x CP, and TP under sequence parallel."""

    def __init__(self, model: torch.nn.Module, arch: ModelArch):
        self.arch = arch
        self.layers = routers(model)
        n = len(self.layers)
        self.counts = torch.zeros(n, arch.num_experts, dtype=torch.float64)
        self.prob_sums = torch.zeros(n, arch.num_experts, dtype=torch.float64)
        self.entropy = torch.zeros(n, dtype=torch.float64)
        self.tokens = torch.zeros(n, dtype=torch.float64)
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingStats:
        for i, router in enumerate(self.layers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            probs, routing_map = output
            with torch.no_grad():
                x = args[0]
                logits = module.gating(x.detach()).float().reshape(-1, self.arch.num_experts)
                p = torch.softmax(logits, dim=-1)
                self.counts[index] += routing_map.reshape(-1, self.arch.num_experts).sum(0).double().cpu()
                self.prob_sums[index] += p.sum(0).double().cpu()
                self.entropy[index] += float(-(p * torch.log(p.clamp_min(1e-30))).sum())
                self.tokens[index] += logits.shape[0]
        return hook

    def reduce(self, groups: list[Any]) -> None:
        import torch.distributed as dist

        flat = torch.cat([self.counts.flatten(), self.prob_sums.flatten(), self.entropy, self.tokens])
        for g in groups:
            dist.all_reduce(flat, group=g)
        n, e = self.counts.shape
        self.counts = flat[:n * e].view(n, e)
        self.prob_sums = flat[n * e:2 * n * e].view(n, e)
        self.entropy = flat[2 * n * e:2 * n * e + n]
        self.tokens = flat[2 * n * e + n:]

    def metrics(self) -> dict[str, float]:
        """Means over this stage's MoE layers (sums for the pipeline's `_sum_metrics`: each stage
        reports its layers' sums and count)."""
        if not self.layers or float(self.tokens.min()) == 0:
            return {}
        tokens = self.tokens.unsqueeze(1)
        share = self.counts / (tokens * self.arch.moe_topk)  # f_e
        mean_prob = self.prob_sums / tokens  # P_e
        load = self.counts.max(1).values / self.counts.mean(1)
        return {"moe/layers": float(len(self.layers)),
                "moe/tokens_per_expert_max_over_mean": float(load.sum()),
                "moe/load_balancing_loss": float((self.arch.num_experts * (share * mean_prob).sum(1)).sum()),
                "moe/router_entropy": float((self.entropy / self.tokens).sum())}
