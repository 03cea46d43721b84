"""FsdpEngine: one rank's FSDP2 shard of a HF causal LM (actor, reference or critic).

The model is whatever `AutoModelForCausalLM` builds from the folder; its weights are kept in fp32 and
sharded over the group's ranks (`fully_shard` on every decoder layer, then on the root, which holds the
embedding, the final norm, the output layer and a critic's value head). bf16 runs compute in bf16 from
the fp32 shards and reduce-scatters gradients in fp32 (torch's MixedPrecisionPolicy): the fp32 shards
are the optimizer's masters. Gradients are summed over DP, not averaged (the losses' token weights are
normalised over the whole mini-batch, as for the Megatron engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.engines.fsdp.attention import attention_implementation, takes_block_mask
from hpcrl.engines.fsdp.forward import ForwardMixin
from hpcrl.engines.fsdp.lora import (
    FsdpLora,
    adapter_pairs,
    apply_peft_lora,
    hf_base_name,
    is_adapter,
    merged,
    peft_name,
)
from hpcrl.engines.fsdp.shards import gather_full, local_shard
from hpcrl.engines.megatron.lora import LoraSettings
from hpcrl.engines.megatron.optimizer import OptimSettings

log = logging.getLogger(__name__)


@dataclass
class FsdpOptions:
    dtype: torch.dtype = torch.float32  # compute dtype (the shards stay fp32)
    # packed micro-batches of at most this many tokens (a longer sequence alone)
    micro_batch_tokens: int = 4096
    # false: micro_batch_size sequences per micro-batch, one right-padded row each
    packing: bool = True
    micro_batch_size: int = 4
    # the samples of one prompt share it in a packed row (where the attention takes a mask: forward.py)
    share_prompt: bool = True
    # none | full: each decoder layer's activations recomputed in the backward (activation checkpointing)
    recompute: str = "none"
    # GPU: parameters, gradients and optimizer state in host memory between uses (torch's CPUOffloadPolicy)
    cpu_offload: bool = False
    # free the gathered full parameters of a layer after its forward (ZeRO-3); false keeps them to the
    # backward (ZeRO-2: more memory, one all-gather fewer per layer)
    reshard_after_forward: bool = True
    # keep the gathered parameters and unsharded gradients across one step's micro-batches (one
    # all-gather and one reduce-scatter per optimizer step)
    accumulate_unsharded: bool = False
    # transformers' attn_implementation (attention.py); None: flash_attention_2 on CUDA with flash_attn
    # installed, else transformers' default
    attn_implementation: str | None = None
    # LoRA adapters through PEFT (hpcrl.engines.fsdp.lora), the actor's; a PEFT folder to start from
    lora: LoraSettings | None = None
    lora_adapters: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _load_hf(model_path: str, requested: str | None, cuda: bool) -> Any:
    """The HF causal LM in fp32 with its attention implementation (attention.py). A failure is told
    apart by loading again with transformers' default: the model's (model.path) or the attention's
    (actor.fsdp.attn_implementation; where the engine chose flash attention itself, it warns and keeps
    the default)."""
    from transformers import AutoModelForCausalLM

    def load(attention: str | None) -> Any:
        extra = {"attn_implementation": attention} if attention else {}
        try:
            return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **extra)
        except (ImportError, OSError, ValueError, KeyError) as e:
            return e

    attention = attention_implementation(requested, cuda)
    hf = load(attention)
    if not isinstance(hf, Exception):
        return hf
    default = load(None) if attention else hf
    if isinstance(default, Exception):
        raise ValueError(f"model.path={model_path}: transformers cannot build it as a causal LM ({default})") \
            from default
    if requested:
        raise ValueError(f"actor.fsdp.attn_implementation={requested}: transformers cannot load {model_path} "
                         f"with it ({hf}). Set it to null (the default) or sdpa.") from hf
    log.warning("flash_attention_2 did not load (%s): transformers' default attention instead", hf)
    return default


@dataclass(frozen=True)
class HfArch:
    """What the roles and the rollout engine's KV-cache sizing read of a model (from config.json)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_hf_arch(model_path: str) -> HfArch:
    """The HF config's shape fields; ValueError naming the folder when it is not a causal LM transformers
    knows (the caller turns that into exit 2 before any allocation)."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model.path={model_path}: transformers cannot load its config.json ({e})") from e
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    return HfArch(architecture=(cfg.architectures or [type(cfg).__name__])[0], vocab_size=int(text.vocab_size),
                  hidden_size=hidden, num_layers=int(text.num_hidden_layers), num_heads=heads,
                  num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                  head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
                  max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
                  tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                  num_experts=int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
                                  or 0))


class CausalLMWithHeads(torch.nn.Module):
    """The HF model with the output computed only where asked: the decoder's hidden states at the
    selected positions, then the output layer (or a critic's value head). The root of the FSDP tree
    (its hooks gather the embedding, final norm and heads)."""

    def __init__(self, hf: torch.nn.Module, value_head: torch.nn.Linear | None):
        super().__init__()
        self.hf = hf
        self.value_head = value_head
        self.softcap = getattr(hf.config, "final_logit_softcapping", None)  # Gemma-2/3 cap their logits

    def forward(self, input_ids: torch.Tensor, select: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Output at the `select`ed positions of input_ids [B, T] (all when None); position_ids restart
        at each sequence of a packed row; attention_mask: a [B, 1, T, T] mask (True/0 = attend)."""
        hidden = self.hf.base_model(input_ids=input_ids, position_ids=position_ids,
                                    attention_mask=attention_mask).last_hidden_state
        if select is not None:
            hidden = hidden[select]
        if self.value_head is not None:
            return self.value_head(hidden)[..., 0]
        logits = self.hf.get_output_embeddings()(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _decoder_layers(hf: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The model's list of decoder layers (each gets its own FSDP unit)."""
    for module in hf.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"{type(hf).__name__}: no list of {num_layers} decoder layers found to shard")


def dp_group(ranks: list[int] | None) -> Any:
    """The process group the engine shards over: the world, or (tests) a subset of its ranks, created
    by those ranks alone. torch names such a group after its ranks and the number of groups each
    member has so far: the members must have made equally many."""
    import torch.distributed as dist

    if ranks is None or sorted(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(sorted(ranks), use_local_synchronization=True)


class FsdpEngine(ForwardMixin):
    """This rank's FSDP2 shard of one model."""

    kind = "fsdp"

    def __init__(self, model_path: str, options: FsdpOptions | None = None, value_head: bool = False,
                 optim: OptimSettings | None = None, ranks: list[int] | None = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        self.options = options or FsdpOptions()
        self.value_head = value_head
        self.arch = read_hf_arch(model_path)
        self.group = dp_group(ranks)
        self.dp_rank, self.dp_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        # the Megatron engine's coordinates, for the roles: one model-parallel rank, every replica an output rank
        self.tp_rank = self.pp_rank = self.cp_rank = self.ep_rank = self.experts_offset = 0
        self.tp_size = self.pp_size = self.cp_size = self.ep_size = 1
        self.replica_rank, self.replicas = self.dp_rank, self.dp_size
        self.is_output_rank = True
        self.is_checkpoint_writer = True  # every rank writes its own shard (torch.distributed.checkpoint)
        self.lora: FsdpLora | None = None
        self.spec = "hf-fsdp2"
        self.routes = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        hf = _load_hf(model_path, self.options.attn_implementation, self.device.type == "cuda")
        if self.options.lora is not None and not value_head:  # before fully_shard: PEFT adds modules
            self.lora = apply_peft_lora(hf, self.options.lora, self.arch.is_moe, self.options.lora_adapters)
        head = None
        if value_head:
            hf.lm_head = None  # the critic's output is its own head, never the embedding
            head = torch.nn.Linear(self.arch.hidden_size, 1, dtype=torch.float32)
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
        if self.options.recompute == "full":
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.config.use_cache = False
        # the attention implementations that take pack's block-diagonal mask (forward.py); a sliding
        # window the mask would replace (the longest sequence it stays exact for)
        self.masked_attention = takes_block_mask(hf.config._attn_implementation)
        text = getattr(hf.config, "get_text_config", lambda: hf.config)()
        self.sliding_window = getattr(text, "sliding_window", None) or None
        # built in host memory: fully_shard moves each unit to the device as it cuts it, so a GPU holds
        # one unit's full tensors at a time while the engine builds, never the whole model
        model = CausalLMWithHeads(hf, head)
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.options.reshard_after_forward}
        if self.options.dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.options.dtype, reduce_dtype=torch.float32)
        if self.options.cpu_offload and self.device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        units = [*_decoder_layers(hf, self.arch.num_layers), model]
        for unit in units:
            fully_shard(unit, **kwargs)
        for unit in units:
            # sum, not average, over DP; plain SUM reductions (gloo has no PREMUL_SUM)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.units = units
        self.model = model
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # LoRA: the adapters by name, and each adapted weight's (lora_A, lora_B) names
        self.adapter_params = {n: p for n, p in self.named_trainable() if is_adapter(n)}
        self.adapter_pairs = adapter_pairs(list(self.adapter_params))
        self.optim = optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.step_count = 0
        self.nonfinite_in_a_row = 0
        self.master = None  # the fp32 shards are the masters
        self.record_grads: list[dict[str, torch.Tensor]] | None = None
        if optim is not None:
            self.optimizer = torch.optim.AdamW(self.trainable, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                               weight_decay=optim.weight_decay)

    # weights: HF names, full tensors ------------------------------------------------------------
    @staticmethod
    def hf_name(name: str) -> str:
        """The HF (or value_head.*) name of a parameter of CausalLMWithHeads; a LoRA adapter keeps its
        PEFT module name (`<module>.lora_A.default.weight`)."""
        return hf_base_name(name.removeprefix("hf."))

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(self.hf_name(n), p) for n, p in self.model.named_parameters() if p.requires_grad]

    def megatron_shard(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the model's weights by HF name (DTensors; with LoRA the base weights,
        which `full_weight` merges); `export_hf_stage` gathers them (the Megatron engine's name for a
        rank's part of the weights)."""
        return {self.hf_name(n): p for n, p in self.model.named_parameters() if not is_adapter(n)}

    def full_weight(self, name: str, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The full tensor of one of `megatron_shard`'s entries in `dtype` (a collective); an adapted
        weight with its adapters merged, W + (alpha / r) B A, unless they are off."""
        if self.lora is None or not self.lora.active or name not in self.adapter_pairs:
            return gather_full(shard, dtype)
        a, b = (self.adapter_params[n] for n in self.adapter_pairs[name])
        return merged(gather_full(shard, torch.float32), gather_full(a, torch.float32), gather_full(b, torch.float32),
                      self.lora.scale).to(dtype)

    def export_hf_stage(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (a collective: every rank gathers each one), in the model's dtype;
        tied output weights are not repeated (the HF folder ties them). With LoRA, the weights merged."""
        src = self.megatron_shard() if tensors is None else tensors
        return {k: self.full_weight(k, v, self.options.dtype).cpu() for k, v in src.items()}

    def peft_adapters(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters, full, PEFT-named (the file `PeftModel.from_pretrained` reads; a collective)."""
        return {peft_name(n): gather_full(p, torch.float32).cpu() for n, p in self.adapter_params.items()}

    def stream_rollout_weights(self, bucket_bytes: int, stats: Any) -> Any:
        """HF-named full tensors for the rollout engine, bucket by bucket (hpcrl.engines.fsdp.weights;
        a collective)."""
        from hpcrl.engines.fsdp.weights import stream_fsdp_weights

        return stream_fsdp_weights(self, bucket_bytes, stats)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shards' AdamW moments)."""
        if self.optimizer is None:
            return 0
        return sum(local_shard(v).numel() * local_shard(v).element_size() for st in self.optimizer.state.values()
                   for v in st.values() if torch.is_tensor(v))

    def offload(self) -> bool:
        return False  # FSDP's own CPUOffloadPolicy (actor.fsdp.cpu_offload) keeps the shards in host memory

    def onload(self) -> bool:
        return False
