"""Megatron's process groups on this rank: the one place that creates and destroys them.

`init_model_parallel` builds the TP x CP x PP x DP groups over an initialised torch.distributed world (every
engine of a worker shares them); a later call for another layout first destroys the previous groups.
"""

from __future__ import annotations

from typing import Any

from hpcrl.engines.megatron.cpu_compat import apply_cpu_compat

# The process groups the last `init_model_parallel` created on this rank, destroyed by the next one.
_megatron_groups: list[Any] = []


def init_model_parallel(tp: int, pp: int, seed: int = 1234, timeout_minutes: int = 10, cp: int = 1,
                        ep: int = 1) -> None:
    """Megatron's process groups over the already-initialised torch.distributed world.

    Rank order is megatron's default (tp-cp-ep-dp-pp): TP varies fastest, then CP, then DP, then PP.
    CP ranks hold the same weights and the same data (each its chunks of every sequence): for
    gradients and metrics they are replicas like DP ranks (`get_data_parallel_group(
    with_context_parallel=True)`), for data they are one DP rank.
    EP (mixture-of-experts models): each MoE layer's experts split over `ep` ranks carved from DP x CP,
    expert tensor parallel = TP (megatron's default); the experts' copies are the expert-DP ranks.
    A second call (another layout) first destroys the groups of the first. Why: megatron's
    `destroy_model_parallel` only drops its references, and torch keeps every group alive; a gloo
    group owns a TCP loop thread that wakes every 10 ms. Measured on 4 ranks here: one layout
    makes 17-21 groups (51-60 threads); an idle rank with 100 leftover groups burnt 16% of a core
    and its all_reduce took 2x as long.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    apply_cpu_compat()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    registry = dist.distributed_c10d._world.pg_map  # torch has no public list of its groups
    for group in _megatron_groups:
        if group in registry:  # megatron hands out some groups under two names
            dist.destroy_process_group(group)
    before = set(registry)
    # megatron's gloo copies of its data-parallel groups serve only its own optimizers (hpcrl's
    # optimizer is torch's, see MegatronEngine): not made, 3 groups fewer
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 distributed_timeout_minutes=timeout_minutes,
                                 create_gloo_process_groups=False)
    _megatron_groups[:] = [g for g in registry if g not in before]
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
