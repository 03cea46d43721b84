"""One rank's share of a Megatron-core model role (actor, reference, critic, reward model): the class
that builds it and the map of where each job lives.

  engine.py      MegatronEngine: builds the model from the HF config and loads its weights, LoRA, the
                 value head; EngineOptions
  parallel.py    init_model_parallel: megatron's process groups (their one owner)
  context_parallel.py  CP: each sequence's chunks on the CP ranks, per-token results gathered back
  moe.py         mixture of experts: megatron's MoE settings, router loss terms, routing statistics
  attention.py   the local spec's per-sequence attention (CP: keys and values gathered over CP)
  weights.py     weights in and out: HF / Megatron shards, adapters, HF export, offload
  forward.py     packed micro-batches, the forward schedule, log-probs, entropies, values
  train_step.py  one optimizer step over a mini-batch, metrics summed over ranks
  optimizer.py   AdamW, fp32 masters, ZeRO-1 shards, gradient reduction, norm and clip, LR schedule

The engine is launch-agnostic: it needs torch.distributed initialised among the worker ranks and
megatron's parallel_state set up for its layout (`init_model_parallel`); the worker-group methods of the
controller runtime call into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hpcrl.engines.megatron.forward import ForwardMixin, thd_params
from hpcrl.engines.megatron.lora import LoraSettings, LoraState, apply_lora
from hpcrl.engines.megatron.model import ModelArch, build_gpt_model, read_arch
from hpcrl.engines.megatron.moe import MoeSettings, own_router_replays
from hpcrl.engines.megatron.optimizer import OptimizerMixin, OptimSettings, lr_factor, square_sum
from hpcrl.engines.megatron.parallel import init_model_parallel
from hpcrl.engines.megatron.train_step import TrainStepMixin
from hpcrl.engines.megatron.weights import WeightsMixin

if TYPE_CHECKING:
    from hpcrl.engines.megatron.optim_shards import OptimizerShards

# the names other modules import from here
__all__ = ["EngineOptions", "MegatronEngine", "OptimSettings", "ValueHead", "init_model_parallel", "lr_factor",
           "square_sum", "thd_params"]


class ValueHead(torch.nn.Module):
    """Scalar value per position, in place of the vocab-parallel output layer (critic role).

    Replicated on every TP rank: its input is replicated there, so its gradients agree without
    any reduction, like a norm weight."""

    def __init__(self, hidden: int, dtype: torch.dtype, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # the whole sequence on every TP rank, as the vocabulary projection gathers it; the
            # backward keeps this rank's slice of the gradient (the head is replicated, not split)
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


@dataclass
class EngineOptions:
    dtype: torch.dtype = torch.float32
    # Packed micro-batches of at most this many tokens; packing=False is the padded baseline
    # (micro_batch_size whole sequences per micro-batch, each padded to the longest).
    micro_batch_tokens: int = 4096
    packing: bool = True
    micro_batch_size: int = 4
    use_te: bool | None = None
    # local spec: per_sequence attention (hpcrl.engines.megatron.attention) or the dense block mask
    attention: str = "per_sequence"
    # Sequences that begin with the same tokens before their first loss / needed position (the
    # samples of one prompt) are packed with that prefix once (hpcrl.engines.megatron.packing).
    # Local spec only: Transformer Engine's packed attention has no prefix-sharing mask.
    share_prompt: bool = True
    # LoRA adapters on the linear layers (hpcrl.engines.megatron.lora); the base weights are frozen.
    # Local spec only: Transformer Engine fuses the pre-norm into linear_qkv/linear_fc1, which hides
    # the normalised input an adapter reads.
    lora: LoraSettings | None = None
    lora_adapters: str | None = None  # a PEFT LoRA folder to start the adapters from
    # megatron's sequence parallel (TP > 1): norms and residuals on a 1/TP slice of the sequence
    sequence_parallel: bool = False
    # activation recompute: none | selective (core attention) | full (every layer from its input)
    recompute: str = "none"
    # an MoE model's router loss terms (hpcrl.engines.megatron.moe); ignored for dense models
    moe: MoeSettings = field(default_factory=MoeSettings)
    extra: dict[str, Any] = field(default_factory=dict)


class MegatronEngine(WeightsMixin, ForwardMixin, TrainStepMixin, OptimizerMixin):
    """This rank's shard of one model (actor, reference or critic)."""

    def __init__(self, model_path: str, options: EngineOptions | None = None, value_head: bool = False,
                 optim: OptimSettings | None = None):
        from megatron.core import parallel_state as ps

        self.options = options or EngineOptions()
        self.value_head = value_head
        arch = read_arch(model_path)
        if value_head and arch.tie_word_embeddings:
            # the critic's head is its own parameter, never the embedding
            from dataclasses import replace
            arch = replace(arch, tie_word_embeddings=False)
        self.arch: ModelArch = arch
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        # CP ranks share the data of their DP rank and hold the same weights: for gradients, metrics,
        # writers and weight senders the copies of a stage are the DP x CP replicas (megatron's order:
        # CP varies faster than DP)
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        self.replica_rank = self.cp_rank + self.cp_size * self.dp_rank
        self.replicas = self.cp_size * self.dp_size
        # the rank of a stage's DP replica that hands out per-sequence results (every CP rank has them)
        self.is_output_rank = self.tp_rank == 0 and self.cp_rank == 0
        # MoE: this rank's experts are experts_offset .. + E / EP - 1 (EP ranks carved from DP x CP)
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.experts_offset = self.ep_rank * (arch.num_experts // self.ep_size) if arch.is_moe else 0
        if self.ep_rank != self.replica_rank % self.ep_size:  # what the reshard and checkpoints rely on
            raise RuntimeError(f"megatron's expert-parallel rank {self.ep_rank} is not replica {self.replica_rank} "
                               f"mod EP={self.ep_size}")
        # who writes this rank's part of a checkpoint: the first replica (with EP: of its EP rank)
        self.is_checkpoint_writer = self.replica_rank < self.ep_size
        if self.options.lora is not None and self.options.sequence_parallel:
            raise ValueError("LoRA adapters with sequence parallel are not supported: turn "
                             "actor.parallel.sequence_parallel off for LoRA runs")
        use_te = False if self.options.lora is not None else self.options.use_te
        self.model = build_gpt_model(self.arch, self.options.dtype, use_te, self.options.attention,
                                     self.options.sequence_parallel, self.options.recompute, self.options.moe)
        self.spec = self.model.hpcrl_spec
        own_router_replays(self.model)
        # routing replay: per-sequence experts [len, layers, k] the next forwards take (routing_replay.py)
        self.routes: list[torch.Tensor] | None = None
        self.record_routing = False
        if value_head and self.model.post_process:
            self.model.output_layer = ValueHead(self.arch.hidden_size, self.options.dtype,
                                                self.options.sequence_parallel).to(next(self.model.parameters()).device)
        self.load_hf(model_path)
        self.lora: LoraState | None = None
        if self.options.lora is not None:
            self.lora = apply_lora(self.model, self.options.lora, self.arch, self.pp_rank, self.pp_size,
                                   self.tp_rank, self.tp_size)
            if self.options.lora_adapters:
                self.load_adapters_peft(self.options.lora_adapters)
        # what the optimizer steps and checkpoints hold: every parameter, or the adapters alone
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # positions [B, T] (label-aligned) whose logits the running micro-batch needs, or None for all
        self._positions: torch.Tensor | None = None
        self._select_output_positions()
        # "positions": each token's position [B, T] while a micro-batch with shared prefixes runs
        self._rope: dict[str, torch.Tensor | None] = {"positions": None}
        self._rope_by_position = self._positions_drive_rope()
        self.optimizer: torch.optim.Optimizer | None = None
        self.optim = optim
        self.step_count = 0
        self.nonfinite_in_a_row = 0  # optimizer steps skipped for a non-finite gradient, since the last good one
        # bf16 weights get fp32 master copies for the optimizer (as megatron's mixed-precision
        # optimizer does): Adam's small updates vanish when added to bf16 weights directly.
        # (the masters of the parameters this rank steps: None at the others' places, see `shards`)
        self.master: list[torch.nn.Parameter | None] | None = None
        # ZeRO-1: which DP rank keeps and steps which trainable parameter; None when this rank steps all
        self.shards: OptimizerShards | None = None
        # Gradients of the last train_step before clipping, HF-named per step, when a test asks
        # (`record_grads = []`): the reference-step tests compare them with an independent PPO step.
        self.record_grads: list[dict[str, torch.Tensor]] | None = None
        if optim is not None:
            self._build_optimizer(optim)
