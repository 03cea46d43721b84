"""vLLM's CPU mixture-of-experts weights after an in-place reload: packed again for the CPU kernel.

vLLM's CPU fused-MoE kernel (`CPUUnquantizedExperts`) runs on a prepacked copy of each layer's expert
weights (`cpu_prepack_moe_weight`), which the first load makes. vLLM 0.32's in-place reload
(`reload_weights`, what `RolloutEngine.load_weights` calls) loads the new weights in checkpoint
layout and then skips that step on a weight update (`UnquantizedFusedMoEMethod._setup_kernel` runs
the experts' `process_weights_after_loading` on the first load only), so the kernel read unpacked
weights as packed ones: reloading the very same weights moved the tiny Qwen3-MoE's log-probs by
0.09 nats. `repack_experts` packs every MoE layer's freshly loaded weights as the first load does.
It runs inside vLLM's worker through `LLM.collective_rpc`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def reloaded_expert_prefixes(names: Iterable[str]) -> set[str]:
    """The MoE layers (`model.layers.<i>.mlp.experts.`) that HF-named tensors `names` belong to."""
    return {name.split(".experts.")[0] + ".experts." for name in names if ".experts." in name}


def repack_experts(worker: Any, prefixes: set[str]) -> int:
    """Prepack the expert weights of the CPU fused-MoE layers under `prefixes` (the layers a reload
    wrote; packing a packed layer again would scramble it); returns how many."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.utils import replace_parameter

    model = worker.model_runner.model
    packed = 0
    for qualified, layer in model.named_modules():
        if not any(qualified.startswith(p) for p in prefixes):
            continue
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            replace_parameter(layer, name, cpu_prepack_moe_weight(getattr(layer, name), experts.isa))
        packed += 1
    return packed
