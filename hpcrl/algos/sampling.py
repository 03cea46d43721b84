"""DAPO's sample-level shaping (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale"): dynamic sampling and the soft overlong punishment."""

from __future__ import annotations

import torch


def groups_with_signal(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Bool [B]: the rows whose group's scores are not all equal (DAPO sec. 3.2, dynamic sampling).

    A group whose samples all score the same (all right or all wrong) has zero group-relative
    advantage, so it adds no gradient but still dilutes the batch; dynamic sampling drops it and
    refills. Equality is exact (rule-based scores are discrete); a group of one sample has no
    signal. Groups may be interleaved in the batch."""
    uniq, idx = torch.unique(group, return_inverse=True)
    x = scores.to(torch.float64)
    lo = torch.full((uniq.numel(),), float("inf"), dtype=x.dtype, device=x.device)
    hi = torch.full((uniq.numel(),), float("-inf"), dtype=x.dtype, device=x.device)
    lo = lo.scatter_reduce(0, idx, x, reduce="amin")
    hi = hi.scatter_reduce(0, idx, x, reduce="amax")
    return (hi > lo)[idx]


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (sec. 3.4, eq. 13), added to the score, float [B]:

        0                                   if len <= max - buffer
        penalty * ((max - buffer) - len) / buffer   if max - buffer < len <= max
        -penalty                            if len > max

    A hard penalty on truncated answers punishes sound but long reasoning; the linear ramp over the
    last `buffer` tokens tells the policy to shorten gradually. buffer = 0 turns it off (zeros)."""
    if buffer < 0:
        raise ValueError(f"algorithm.overlong_buffer must be >= 0, got {buffer}")
    lengths = response_lengths.to(torch.get_default_dtype())
    if buffer == 0:
        return torch.zeros_like(lengths)
    start = float(max_new_tokens - buffer)
    ramp = (start - lengths) / buffer * penalty
    return ramp.clamp(min=-penalty, max=0.0)
