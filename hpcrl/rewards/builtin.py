"""The builtin rule-based scorer (`reward.function: builtin`), chosen by each sample's data_source.

Two styles:
- "gsm8k" (hpcrl/arith, openai/gsm8k, gsm8k): the answer is expected after `#### `;
- "math" (MATH-style sets): the answer is expected in `\\boxed{...}`.
Accuracy is 1 when the extracted answer equals the ground truth (`equality.answers_equal`), else 0.
Format is 1 when the answer was given the expected way (GSM8K: `#### N` with N a number; MATH: a
`\\boxed{}`) and the completion was not truncated at max_new_tokens (a cut-off answer is unfinished).
score = acc + format_weight * format.

`compute_score` has verl's reward-function signature, so a custom function can wrap it.
"""

from __future__ import annotations

from typing import Any

from hpcrl.rewards.equality import answers_equal
from hpcrl.rewards.extract import boxed_answer, extract_answer, hash_answer, is_number

_STYLES = {
    "hpcrl/arith": "gsm8k",
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "math": "math",
    "math500": "math",
    "lighteval/math": "math",
    "digitallearninggmbh/math-lighteval": "math",
    "huggingfaceh4/math-500": "math",
    "hendrycks/competition_math": "math",
}


def style_of(data_source: str) -> str | None:
    """"gsm8k", "math", or None when the builtin scorer does not know this data_source."""
    return _STYLES.get(str(data_source).strip().lower())


def known_data_sources() -> list[str]:
    return sorted(_STYLES)


def unknown_data_source_error(data_source: str) -> ValueError:
    return ValueError(
        f"reward.function=builtin has no rule for data_source={data_source!r} (it knows: "
        f"{', '.join(known_data_sources())}). Set reward.function to 'package.module:function', a function "
        "fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict that scores it."
    )


def gold_answer(ground_truth: str, style: str) -> str:
    """The answer part of a ground truth that may be a whole worked solution (raw GSM8K ends in
    '#### N', raw MATH solutions box the answer)."""
    gt = str(ground_truth)
    if style == "gsm8k" and "####" in gt:
        return hash_answer(gt) or gt.strip()
    if style == "math" and ("\\boxed" in gt or "\\fbox" in gt):
        return boxed_answer(gt) or gt.strip()
    return gt.strip()


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  *, format_weight: float = 0.0, truncated: bool = False) -> dict[str, Any]:
    """Score one completion: {"score", "acc", "format", "pred"}. Raises ValueError for an unknown
    data_source (the scorer checks every batch for that before scoring)."""
    style = style_of(data_source)
    if style is None:
        raise unknown_data_source_error(data_source)
    pred, method = extract_answer(solution_str)
    if style == "gsm8k":
        fmt = method == "hash" and is_number(pred)
    else:
        fmt = method == "boxed"
    fmt = 1.0 if fmt and not truncated else 0.0
    acc = 1.0 if pred is not None and answers_equal(pred, gold_answer(ground_truth, style)) else 0.0
    return {"score": acc + format_weight * fmt, "acc": acc, "format": fmt, "pred": pred or ""}
