"""The HF architectures the Megatron engine converts, in a module without torch: `hpcrl run`, `hpcrl config` and
`hpcrl submit` check a config against it before anything starts, and importing torch for a table cost each of
them ~2.3 s of CPU (hpcrl/engines/megatron/model.py builds the models)."""

from __future__ import annotations

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama",
             "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
# Reward models: the same backbones with a one-label `score` head (read by the engine's value head).
SUPPORTED.update({k.replace("ForCausalLM", "ForSequenceClassification"): v for k, v in list(SUPPORTED.items())})
