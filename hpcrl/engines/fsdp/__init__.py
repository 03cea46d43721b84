"""The FSDP2 training engine: any HF causal LM (AutoModelForCausalLM), sharded over the data-parallel
ranks with torch's `fully_shard`, beside the Megatron engine (`actor.engine=fsdp`).

  engine.py   FsdpEngine: builds the model from the HF folder (no weight converter: every family
              transformers loads), a value head for the critic, FSDP2 per decoder layer and at the
              root, mixed precision (bf16 compute, fp32 shards, fp32 gradient reduction), activation
              checkpointing, CPU offload (GPU); HF-named full tensors out (export, reshard, tests)
  forward.py  micro-batches laid out as Megatron's (packed rows, prompts shared, or padded rows), each
              sequence attending to itself only, the forward (logits only where needed),
              log-probs at the sampling temperature, entropies, values, and the optimizer step
              (AdamW over the fp32 shards, global gradient norm and clip, non-finite steps skipped)
  attention.py  which attention implementation the model is loaded with (actor.fsdp.attn_implementation)
  lora.py     LoRA through PEFT's own layers (put in before sharding), adapters off for the reference,
              merged weights, PEFT names
  weights.py  the reshard to vLLM: full tensors gathered bucket by bucket on every rank (merged with
              their LoRA adapters)
  shards.py   a shard's full tensor (plain synchronous all-gather of the padded dim-0 shards)

The engine offers what the roles (hpcrl.workers.megatron_roles) ask of an engine, with the Megatron
engine's names, so the loop does not know which engine runs: one model layout (TP = PP = CP = 1),
every rank an output rank, DP = the ranks of the group. It needs torch.distributed initialised among
the worker ranks and nothing of megatron's parallel state.
"""
