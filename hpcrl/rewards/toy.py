"""A reward a tiny random model can learn in a few GRPO steps.

CI's end-to-end GRPO test trains a 0.56M-parameter random Qwen2 for a handful of steps; it can never
solve arithmetic, so a math reward would stay at 0 and the test could not tell a working update from a
broken one. The share of digits in the output is graded (not 0/1), so every group of samples has
reward differences to learn from at the first step, and a rising mean reward shows that the loop
learns. Use with `reward.function=hpcrl.rewards.toy:digit_fraction`.
"""

from __future__ import annotations


def digit_fraction(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Fraction of the non-whitespace characters of the completion that are ASCII digits (0.0 if none)."""
    chars = [c for c in solution_str if not c.isspace()]
    if not chars:
        return 0.0
    return sum(1 for c in chars if c in "0123456789") / len(chars)
