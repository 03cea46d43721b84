"""vLLM rollout engine, colocated with the trainer's shard in the same worker process."""

from hpcrl.engines.vllm.engine import RolloutEngine, SamplingSettings

__all__ = ["RolloutEngine", "SamplingSettings"]
