"""What the controller hands the reward scorer and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardInput:
    """One completion to score; the fields come from the prompt's dataset row and the rollout."""

    data_source: str
    response: str  # decoded completion text (special tokens skipped)
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt: str = ""
    truncated: bool = False  # the completion hit max_new_tokens


@dataclass
class RewardResult:
    """Scores in input order, batch metrics for the logger, and per-sample details for debugging.

    metrics: reward/mean, reward/errors and reward/timeouts (counts), time/reward (seconds), and when known
    reward/format_mean, reward/acc_mean, reward/acc/<data_source>, reward/<key> for every other numeric
    key a custom function returned in its dict (mean over the samples that had it).
    details[i]: {"score", "acc", "format", "error" (str or None), "timeout" (bool), "pred" (the extracted
    answer or ""), "extra" (other numeric keys)}; acc and format are None when the function gave none.
    """

    scores: list[float]
    metrics: dict[str, float]
    details: list[dict[str, Any]]
