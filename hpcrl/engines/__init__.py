"""Engines: the Megatron-core trainer and the vLLM rollout engine, and resharding between them."""
