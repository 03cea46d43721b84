"""Megatron-core trainer: model build from HF configs, weight conversion, packing, the engine."""
