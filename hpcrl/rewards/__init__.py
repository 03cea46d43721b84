"""Reward scoring for the RL loop: the builtin rule-based math scorer, custom `module:function`
rewards (verl's signature), run in killable worker processes with per-sample timeouts.

The controller builds one `RewardScorer` from the `reward` config and calls `score` once per step.
"""

from hpcrl.rewards.scorer import RewardScorer
from hpcrl.rewards.types import RewardInput, RewardResult

__all__ = ["RewardInput", "RewardResult", "RewardScorer"]
