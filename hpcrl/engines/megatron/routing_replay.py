"""Routing replay in the Megatron engine: the MoE routers take the experts the rollout engine chose
for each token (hpcrl.engines.vllm.routing records them) instead of choosing again.

  layout_routes    per-sequence routes [len, layers, k] -> the packed micro-batch's places [B, T, layers, k]
                   (a shared prompt once, from its first sample; padding and unknown tokens -1)
  ReplayRouting    sets megatron's RouterReplay targets of this stage's routers for a micro-batch (this CP
                   rank's places, this TP rank's slice under sequence parallel), and records what the
                   routers used (`recorded`), for the checks
  unlayout_routes  the inverse of `layout_routes`: per-sequence routes from a micro-batch's places

megatron's router with a replay target gathers the router's scores at the given experts (as its
`RouterReplayAction.REPLAY_FORWARD` does), so the routing weights still come from this model's router:
the gradient reaches the router through them, as in Megatron-LM's and verl's routing replay. A place
with no recorded route (-1: the last token of a sequence, which is never fed back to vLLM; padding)
keeps the router's own top-k (`_replay_topk` replaces megatron's replay top-k of this model's routers,
which would index with the -1).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.engines.megatron.packing import PackedMicroBatch


def layout_routes(mb: PackedMicroBatch, routes: list[torch.Tensor]) -> torch.Tensor:
    """[B, T, layers, k] int64 routes at the places of a packed micro-batch (its whole rows: the CP
    parts are cut afterwards); -1 where nothing was recorded."""
    b, t = mb.tokens.shape
    layers, k = routes[0].shape[1:]
    out = torch.full((b, t, layers, k), -1, dtype=torch.long)
    for p in mb.placement:
        r = routes[p.seq].long()
        out[p.row, p.offset:p.offset + p.length] = r[p.start:p.start + p.length]
        if p.start and p.prefix >= 0:
            out[p.row, p.prefix:p.prefix + p.start] = r[:p.start]
    return out


def unlayout_routes(places: torch.Tensor, mb: PackedMicroBatch, lengths: list[int]) -> dict[int, torch.Tensor]:
    """Per-sequence [len, layers, k] routes from [B, T, layers, k] places (the inverse of `layout_routes`)."""
    out = {}
    for p in mb.placement:
        seq = torch.full((lengths[p.seq], *places.shape[2:]), -1, dtype=places.dtype)
        seq[p.start:p.start + p.length] = places[p.row, p.offset:p.offset + p.length]
        if p.start and p.prefix >= 0:
            seq[:p.start] = places[p.row, p.prefix:p.prefix + p.start]
        out[p.seq] = seq
    return out


def local_places(places: torch.Tensor, mb: PackedMicroBatch, sp_rank: int, sp_size: int) -> torch.Tensor:
    """This rank's places: its CP chunks (mb.index of a CP micro-batch), then its SP slice."""
    index = getattr(mb, "index", None)
    if index is not None:  # CP: the rank's tokens are chunks from all over each row
        from megatron.core import parallel_state as ps

        mine = index[ps.get_context_parallel_rank()]
        places = places.gather(1, mine[:, :, None, None].expand(-1, -1, *places.shape[2:]))
    if sp_size > 1:
        n = places.shape[1] // sp_size
        places = places[:, sp_rank * n:(sp_rank + 1) * n]
    return places


def _router_order(places: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> the router's token order [T * B, ...] (megatron's hidden states are [T, B, H])."""
    return places.transpose(0, 1).reshape(-1, *places.shape[2:])


def _replay_topk(replay: Any, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                 group_topk: int | None = None, default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's `RouterReplay.get_replay_topk` for hpcrl: the target experts where they are known,
    the router's own top-k elsewhere (and everywhere without a target)."""
    values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    target = replay.target_topk_idx
    if target is None:
        return values, indices
    target = target.to(scores.device)
    known = (target >= 0).all(-1, keepdim=True)
    indices = torch.where(known, target, indices)
    return scores.gather(1, indices), indices


class ReplayRouting:
    """This stage's routers replay given experts during a forward (or only record what they used)."""

    def __init__(self, routers: list[torch.nn.Module], first_layer: int):
        from functools import partial

        self.routers = routers
        self.first_layer = first_layer
        self.recorded: list[list[torch.Tensor]] = []  # per forward: per router [tokens, k] experts used
        # this rank's routed places (token x MoE layer) and how many of them took a recorded route
        self.places = 0
        self.replayed = 0
        self._handles: list[Any] = []
        for router in routers:
            rr = router.router_replay
            rr.get_replay_topk = partial(_replay_topk, rr)

    def set_micro_batch(self, places: torch.Tensor | None) -> None:
        """places [B, T_local, layers, k] for this rank's tokens (None: route freely)."""
        for i, router in enumerate(self.routers):
            rr = router.router_replay
            rr.clear_indices()
            rr.target_topk_idx = None if places is None else _router_order(places[:, :, self.first_layer + i])
            if places is not None:
                self.places += rr.target_topk_idx.shape[0]
                self.replayed += int((rr.target_topk_idx >= 0).all(-1).sum())

    def __enter__(self) -> ReplayRouting:
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for router in self.routers:
            router.router_replay.clear_indices()

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            _, routing_map = output
            if index == 0:
                self.recorded.append([])
            k = module.topk
            used = routing_map.float().topk(k, dim=-1).indices.sort(dim=-1).values
            self.recorded[-1].append(used.detach().cpu())
        return hook
