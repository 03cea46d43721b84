"""Which attention implementation the FSDP engine loads the HF model with (`actor.fsdp.attn_implementation`,
passed to transformers' `from_pretrained`), and whether it takes pack's block-diagonal mask. No torch:
the planner asks the same questions (hpcrl.plan.fsdp).

- null (the default): flash_attention_2 on CUDA where the flash_attn package is installed (varlen
  attention: transformers cuts each packed row where its positions restart, no T x T mask), else
  transformers' own default (sdpa where the model has it, else eager).
- sdpa and eager take the block-diagonal [rows, 1, T, T] mask (forward.py), the only way the samples
  of a prompt share its one copy (actor.share_prompt); every other implementation sees packed rows
  through position_ids alone (each sequence laid out whole).
"""

from __future__ import annotations

import importlib.util

MASKED = ("sdpa", "eager")


def attention_implementation(requested: str | None, cuda: bool) -> str | None:
    """The attn_implementation to load the model with; None: transformers' default."""
    if requested:
        return requested
    if cuda and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def takes_block_mask(implementation: str | None) -> bool:
    """Whether the model attends under pack's block-diagonal mask (None: transformers' default, sdpa or
    eager, both masked)."""
    return implementation is None or implementation in MASKED
