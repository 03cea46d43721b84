"""Engines: the Megatron-core trainer and the vLLM rollout engine, and resharding between them."""

from __future__ import annotations

import os


def no_compile_on_cpu() -> bool:
    """On a CPU-only torch, turn torch.compile off in this process (each compiled function then
    runs eagerly), unless TORCHDYNAMO_DISABLE is set already. Returns whether compile is off.

    Why: the engines run eagerly on CPU anyway (vLLM with enforce_eager, megatron's local spec),
    but a few helpers are still compiled on first call in every process, vLLM's sampler rank count
    above all. Measured with `hpcrl run configs/grpo_tiny.yaml` (4 workers, TP=2, 3 steps): the
    first step took 8.5 s with compile and 2.4 s without, building the worker groups 47 vs 42 s,
    the whole run 102 vs 89 s, and every step record was the same. GPUs keep torch.compile.
    Called by both engines before they import their library: torch.compile reads the variable
    when it decorates, Dynamo's flag covers functions decorated before.
    """
    import torch

    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if os.environ["TORCHDYNAMO_DISABLE"] != "1":
        return False
    import torch._dynamo

    torch._dynamo.config.disable = True
    return True
