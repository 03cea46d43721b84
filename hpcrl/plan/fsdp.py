"""The memory plan of a role on the FSDP engine (`actor.engine=fsdp`, `critic.engine` /
`reference.engine`; hpcrl/engines/fsdp): what it holds on one worker in each phase. memory.py puts
these terms where a Megatron role's would be; docs/planner.md, "The FSDP engine", says where each
number comes from.

What maps to what (the engine, torch 2.13's FSDP2 `fully_shard`, one unit per decoder layer and the
root unit over the embedding, final norm and LM head or a critic's value head, over all the trainer's
ranks: DP = the workers, TP = PP = CP = EP = 1):

- `hf_tensors`: the parameters transformers' AutoModelForCausalLM builds, tensor by tensor and unit by
  unit (a critic drops the LM head and adds a value head of h + 1); the model's fp32 parameters.
- `FsdpRole`: one role on one rank. Resident (`add_to`): the fp32 parameter shards (each tensor's rows
  cut over DP as torch.chunk cuts them, every rank padded to the largest chunk), the fp32 gradient
  shards (reduce-scattered in fp32; from a step's first backward to its zero_grad: the update and
  optimizer step phases), Adam's two fp32 moments of the shards (torch AdamW over the shards: they are
  the masters, there is no other copy, whatever model.dtype); nothing of it on the GPU with
  actor.fsdp.cpu_offload (pinned host memory, `host_pinned`). (With reshard_after_forward=false FSDP2
  reshards in the backward only; the engine reshards every unit after a no-grad forward itself, so
  nothing stays gathered between phases.)
- `FsdpRole.add_update`: the update: the root gathered through the forward and backward, one layer
  gathered (every layer with reshard_after_forward=false: with the root a full copy of the model in
  the compute dtype), the all-gather buffers (FSDP2 copies each flat all-gather output into the
  parameters and, in the forward, frees it only at the next layer's all-gather; on GPU the next
  layer's all-gather overlaps: one buffer on CPU, two on GPU), the unsharded gradients before their
  reduce-scatter (the root's through the whole backward, one layer's, and the fp32 reduce-scatter
  input), and the activations: activations.py's count of a decoder layer at TP = 1 with an unfused
  gated MLP (HF's LlamaMLP) and flash-style attention (PyTorch's SDPA), over micro-batches of
  `micro_batch_tokens` tokens (an approximation: HF's RMSNorm upcasts to fp32 and RoPE keeps
  rotated copies of q and k, not counted), the working set of one layer, and the logits over the
  whole vocabulary (no TP) at every position of the micro-batch (the engine computes them at the
  loss positions only: an upper bound).
- `FsdpRole.forward_terms`: a no-grad forward (old log-probs, reference log-probs, values).
- `FsdpRole.add_reshard`: the push to vLLM (hpcrl/engines/fsdp/weights.py): every rank all-gathers
  full tensors in the compute dtype, bucket by bucket (rollout.weight_bucket_mb); on GPU each one
  goes to host memory as it arrives, so the device holds one full tensor, the bucket is host memory
  (a note); on CPU the bucket is in the process.
- `notes`: the engine builds each model whole in fp32 in host memory (from_pretrained) before
  `fully_shard` moves it to the device unit by unit, cutting it: every worker process holds the whole
  fp32 model in host memory while it builds (a note), a GPU one unit's full tensors at a time.
- `precision_line`, `activation_line`, `notes`, `suggestions`: what report.py, estimate and
  suggest.py say of the FSDP roles.

Arithmetic only (no torch): `hpcrl plan` stays a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from hpcrl.config.derived import engine_roles, role_engine, role_layouts
from hpcrl.engines.fsdp.attention import attention_implementation, takes_block_mask
from hpcrl.plan.activations import (
    GIB,
    kept_activation_bytes,
    layer_activations,
    logits_bytes,
    micro_batch_token_count,
    working_elements_per_token,
)
from hpcrl.plan.shape import ModelShape

# (memory.py's Phase, _Run and Estimate are typed Any here: memory.py imports this module)
ENGINE = "fsdp"
ACTIVATIONS_LABEL = "activations kept for backward (HF layers, approximated)"
LOGITS_LABEL = "logits at response positions (whole vocabulary)"
MASK_LABEL = "attention mask of the packed rows (block-diagonal, T x T)"
FORWARD_GATHERED_LABEL = "gathered units of one forward (FSDP all-gather, {dtype})"
# what the optimizer step phase is on the FSDP engine (report.py's column legend)
PHASE_MEANING = {"optimizer step": "gradient norm and clip, then Adam over the shards (gradients were reduce-scattered "
                                   "in the backward)"}


def on_fsdp(cfg: DictConfig, role: str) -> bool:
    """Whether `role` (actor, critic, reference) runs on the FSDP engine."""
    return role_engine(cfg, role) == ENGINE


def micro_batch_tokens(cfg: DictConfig, role: str, seq_len: int) -> int:
    """Tokens of one of the role's micro-batches (the actor's settings for the reference): laid out as
    the Megatron engine lays them out (hpcrl.engines.fsdp.forward `_micro_batches`), so counted as its
    plan counts them (activations.py `micro_batch_token_count`): the packing budget, a longer sequence
    alone, or micro_batch_size padded rows."""
    section = cfg[role] if role in ("actor", "critic") else cfg.actor
    return micro_batch_token_count(section, seq_len)


def attention(cfg: DictConfig, gpu: bool) -> str | None:
    """The attn_implementation the engine loads the model with (hpcrl.engines.fsdp.attention; on GPU
    with the default, flash_attention_2 where flash_attn is installed in this environment)."""
    return attention_implementation(cfg.actor.fsdp.attn_implementation, gpu)


def mask_bytes(cfg: DictConfig, role: str, seq_len: int, gpu: bool = False, compute_bytes: int = 4) -> int:
    """The block-diagonal attention mask of one micro-batch on the device ([rows, 1, T, T], the rows'
    length T squared; hpcrl.engines.fsdp.forward): bool under sdpa, the compute dtype under eager; none
    under flash attention and the other implementations that read position_ids."""
    impl = attention(cfg, gpu)
    if not takes_block_mask(impl):
        return 0
    section = cfg[role] if role in ("actor", "critic") else cfg.actor
    elements = micro_batch_tokens(cfg, role, seq_len) ** 2 if section.packing else \
        int(section.micro_batch_size) * seq_len ** 2
    return elements * (compute_bytes if impl == "eager" else 1)


def hf_tensors(shape: ModelShape, head: str = "lm") -> dict[str, list[tuple[int, int]]]:
    """The HF model's parameter tensors as (rows, elements a row), per FSDP unit: "root" (embedding,
    final norm, LM head unless tied, or a critic's value head [1, h] and bias [1] with no LM head) and
    "layer" (one decoder layer, every layer alike), in the order the reshard walks them."""
    h, d = shape.hidden_size, shape.head_dim
    layer = [(shape.q_dim, h), (shape.kv_dim, h), (shape.kv_dim, h)]
    if shape.qkv_bias:
        layer += [(shape.q_dim, 1), (shape.kv_dim, 1), (shape.kv_dim, 1)]
    layer += [(h, shape.q_dim)]
    if shape.qk_norm:
        layer += [(d, 1), (d, 1)]
    if shape.is_moe:  # transformers' fused experts [E, 2 I_e, h] and [E, h, I_e], and the router [E, h]
        e, ie = shape.num_experts, shape.moe_intermediate_size
        layer += [(e, 2 * ie * h), (e, h * ie), (e, h)]
    else:
        ffn = shape.intermediate_size
        layer += [(ffn, h), (ffn, h), (h, ffn)]
    layer += [(h, 1), (h, 1)]
    root = [(shape.vocab_size, h), (h, 1)]
    if head == "value":
        root += [(1, h), (1, 1)]
    elif not shape.tie_word_embeddings:
        root += [(shape.vocab_size, h)]
    return {"root": root, "layer": layer}


def _numel(tensors: list[tuple[int, int]]) -> int:
    return sum(rows * row for rows, row in tensors)


def _shard(tensors: list[tuple[int, int]], dp: int) -> int:
    """Elements of one rank's shards: each tensor's rows cut over dp, padded to the largest chunk."""
    return sum(-(-rows // dp) * row for rows, row in tensors)


@dataclass
class FsdpRole:
    """One role's bytes on one rank of the FSDP engine (the interface megatron.py's `MegatronRoleShard`
    offers the phases: name, trains, params, resident, at_build; and `add_to`)."""

    name: str
    shape: ModelShape
    dp: int
    compute_dtype: str  # "bf16" | "fp32": the gathered parameters, activations, the reshard's tensors
    trains: bool
    head: str = "lm"
    gpu: bool = False
    on_host: bool = False  # actor.fsdp.cpu_offload on GPU: shards, gradients and moments in host memory
    reshard_after_forward: bool = True
    accumulate_unsharded: bool = False  # actor.fsdp.accumulate_unsharded: every unit gathered over the micro-batches
    adapters: int = 0  # LoRA (actor.lora.rank): the adapters' parameters, the only ones trained (full model)
    units: dict[str, list[tuple[int, int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.units = hf_tensors(self.shape, self.head)

    @property
    def compute_bytes(self) -> int:
        return 2 if self.compute_dtype == "bf16" else 4

    @property
    def root_params(self) -> int:
        return _numel(self.units["root"])

    @property
    def layer_params(self) -> int:
        return _numel(self.units["layer"])

    @property
    def total_params(self) -> int:
        return self.root_params + self.shape.num_layers * self.layer_params

    @property
    def params(self) -> int:
        """Parameters of this rank's shards (LoRA adapters included)."""
        base = _shard(self.units["root"], self.dp) + self.shape.num_layers * _shard(self.units["layer"], self.dp)
        return base + (self.trained_params if self.adapters else 0)

    @property
    def trained_params(self) -> int:
        """Parameters of this rank's shards that the optimizer steps: with LoRA the adapters' share."""
        return -(-self.adapters // self.dp) if self.adapters else self.params

    @property
    def weights(self) -> int:
        return 4 * self.params

    @property
    def step_grads(self) -> int:
        return 4 * self.trained_params if self.trains else 0

    @property
    def adam(self) -> int:
        return 8 * self.trained_params if self.trains else 0

    @property
    def resident(self) -> int:
        return 0 if self.on_host else self.weights + self.adam

    @property
    def at_build(self) -> int:
        return 0 if self.on_host else self.weights

    @property
    def host_bytes(self) -> int:
        """Pinned host memory with actor.fsdp.cpu_offload: shards, gradients (while updating), moments."""
        return self.weights + self.step_grads + self.adam if self.on_host else 0

    def _tag(self, what: str) -> str:
        return f"{what}, {self.compute_dtype}"

    def add_to(self, phase: Any, with_step_grads: bool = False) -> None:
        """The resident rows (megatron.py's `add_role`)."""
        if not self.on_host:
            shard = f"fp32 FSDP shard, 1/{self.dp}"
            phase.add(f"{self.name} weights ({shard})", self.weights)
            if self.trains:
                if with_step_grads:
                    phase.add(f"{self.name} gradients ({shard})", self.step_grads)
                phase.add(f"{self.name} Adam moments (2 x {shard})", self.adam)

    def _buffers(self) -> int:
        """Flat all-gather outputs alive beside the gathered parameters: this layer's (kept to the next
        all-gather in the forward), and on GPU the next layer's, which overlaps this one's compute."""
        return (2 if self.gpu else 1) * self.layer_params * self.compute_bytes

    def _root_label(self) -> str:
        head = "value head" if self.head == "value" else "LM head"
        return f"{self.name} gathered root: embedding, norm, {head} (" + self._tag("FSDP all-gather") + ")"

    def add_update(self, phase: Any, run: Any) -> None:
        """The update's terms beside the resident ones: gathered units, unsharded gradients,
        activations, the working set of one layer and (the actor) the logits."""
        b, layers = self.compute_bytes, self.shape.num_layers
        phase.add(self._root_label(), self.root_params * b)
        if self.accumulate_unsharded:
            phase.add(f"{self.name} gathered layers: all {layers} kept over the micro-batches ("
                      + self._tag("accumulate_unsharded") + ")", layers * self.layer_params * b)
        elif self.reshard_after_forward:
            phase.add(f"{self.name} gathered layer (" + self._tag("FSDP all-gather") + ")", self.layer_params * b)
        else:
            phase.add(f"{self.name} gathered layers: all {layers} kept to the backward ("
                      + self._tag("reshard_after_forward=false") + ")", layers * self.layer_params * b)
        phase.add(f"{self.name} all-gather buffers (" + self._tag("FSDP") + ")", self._buffers())
        if self.adapters:
            # LoRA: the frozen base has no gradient; the adapters' full gradients before their reduce-scatter
            phase.add(f"{self.name} unsharded adapter gradients (LoRA, fp32)", self.adapters * 4)
        elif self.accumulate_unsharded:
            # every unit's full gradient, summed over the step's micro-batches, reduce-scattered at the last
            phase.add(f"{self.name} unsharded gradients accumulated over the micro-batches (fp32)",
                      self.total_params * 4)
        else:
            # the root's gradients live through the whole backward (the LM head's come first, the
            # embedding's last); one layer's at a time, then copied into the fp32 reduce-scatter input
            phase.add(f"{self.name} unsharded gradients before reduce-scatter",
                      self.root_params * b + max(self.layer_params * (b + 4), self.root_params * 4))
        tokens = micro_batch_tokens(run.cfg, self.name, run.seq_len)
        acts = layer_activations(self.shape, run.layouts[self.name], tokens, b, fused_swiglu=False, dense=False)
        phase.add(ACTIVATIONS_LABEL, kept_activation_bytes(acts, layers, 1, run.recompute(self.name)))
        phase.add("working set of one layer", tokens * working_elements_per_token(self.shape, 1) * b)
        phase.add(MASK_LABEL, mask_bytes(run.cfg, self.name, run.seq_len, self.gpu, b))
        if self.head == "lm":
            entropy = float(run.cfg.actor.entropy_coeff) != 0.0
            phase.add(LOGITS_LABEL, logits_bytes(tokens, self.shape.vocab_size, b, entropy))

    def forward_terms(self, run: Any) -> tuple[int, int]:
        """(working set of one layer + logits, gathered units) of one no-grad forward: the root and one
        layer gathered, or, with reshard_after_forward=false, every unit (resharded after the forward)."""
        b = self.compute_bytes
        tokens = micro_batch_tokens(run.cfg, self.name, run.seq_len)
        working = int(tokens * working_elements_per_token(self.shape, 1) * b)
        working += mask_bytes(run.cfg, self.name, run.seq_len, self.gpu, b)
        if self.head == "lm":
            working += logits_bytes(tokens, self.shape.vocab_size, b, entropy=False)
        # every unit gathered by the end of the forward under reshard_after_forward=false (the engine
        # reshards them after it)
        layers = 1 if self.reshard_after_forward else self.shape.num_layers
        gathered = (self.root_params + layers * self.layer_params) * b
        return working, gathered + self._buffers()

    def reshard_bucket(self, bucket_mb: int) -> int:
        """The largest bucket of full tensors the push builds (hpcrl.engines.fsdp.weights: a bucket
        closes before a tensor that would take it past rollout.weight_bucket_mb; a larger tensor is a
        bucket of its own)."""
        limit, b = bucket_mb << 20, self.compute_bytes
        sizes = [rows * row * b for rows, row in self.units["root"][:1]]
        sizes += [rows * row * b for rows, row in self.units["layer"]] * self.shape.num_layers
        sizes += [rows * row * b for rows, row in self.units["root"][1:]]
        largest = size = 0
        for n in sizes:
            if size and size + n > limit:
                size = 0
            size += n
            largest = max(largest, size)
        return largest

    def largest_tensor(self) -> int:
        """Elements of the largest full parameter tensor."""
        return max(rows * row for rows, row in self.units["root"] + self.units["layer"])

    def add_reshard(self, phase: Any, bucket_mb: int) -> None:
        """The push to vLLM: on GPU one full tensor at a time on the device (each goes to host memory
        as it is gathered), on CPU the largest bucket."""
        if self.gpu:
            phase.add("reshard bucket on the device: one full tensor (" + self._tag("FSDP all-gather") + ")",
                      self.largest_tensor() * self.compute_bytes)
        else:
            phase.add("reshard bucket: full tensors gathered (" + self._tag("FSDP all-gather") + ")",
                      self.reshard_bucket(bucket_mb))

    def optimizer_temporaries(self) -> int:
        """One fp32 temporary of the largest shard tensor (as the Megatron plan counts the step's);
        none on the device when the step runs in host memory (cpu_offload)."""
        if self.on_host:
            return 0
        return max(-(-rows // self.dp) * row for rows, row in self.units["root"] + self.units["layer"]) * 4


def fsdp_role(run: Any, name: str, shape: ModelShape, trains: bool, head: str = "lm", adapters: int = 0
              ) -> FsdpRole:
    """`name`'s FsdpRole in this plan (the options are actor.fsdp's for every role, as the engine's);
    adapters: the LoRA adapters' parameters of an actor (megatron.py `lora_shard_params` at TP = PP = 1)."""
    cfg = run.cfg
    options = cfg.actor.fsdp
    return FsdpRole(name, shape, run.layouts[name].dp, run.dtype, trains, head=head, gpu=run.gpu,
                    on_host=run.gpu and bool(options.cpu_offload),
                    reshard_after_forward=bool(options.reshard_after_forward),
                    accumulate_unsharded=bool(options.accumulate_unsharded) and trains, adapters=adapters)


def host_pinned(roles: list[Any], per_node: int) -> dict[str, int]:
    """The pinned host memory per node that actor.fsdp.cpu_offload takes (GPU)."""
    held = [r for r in roles if isinstance(r, FsdpRole) and r.on_host]
    if not held:
        return {}
    names = ", ".join(r.name for r in held)
    return {f"FSDP shards, gradients and Adam moments of the {names} (actor.fsdp.cpu_offload)":
            sum(r.host_bytes for r in held) * per_node}


def notes(run: Any) -> list[str]:
    """What estimate says of an FSDP actor."""
    cfg = run.cfg
    if not on_fsdp(cfg, "actor"):
        return []
    out = []
    if run.gpu:
        actor = fsdp_role(run, "actor", run.shapes.policy, True)
        out.append("actor.engine=fsdp: actor.offload does not apply (the engine's shards stay on the GPU while vLLM "
                   "generates; actor.fsdp.cpu_offload keeps them in host memory throughout)")
        bucket = actor.reshard_bucket(int(cfg.rollout.weight_bucket_mb))
        out.append(f"the reshard builds each bucket of full tensors in host memory (hpcrl/engines/fsdp/weights.py): "
                   f"up to {bucket / GIB:.2f} GiB per worker, beside the process, while it pushes")
    full = 4 * fsdp_role(run, "actor", run.shapes.policy, True).total_params
    unit, name = (GIB, "GiB") if run.gpu else (10**9, "GB")
    where = " in host memory (its GPU gets one unit at a time, cut as it arrives)" if run.gpu else ""
    out.append(f"FSDP start-up: each worker process loads the whole model in fp32 ({full / unit:.2f} {name}){where} "
               "before sharding it; not counted in the phases")
    return out


def precision_line(cfg: DictConfig, dtype: str, device: str) -> str:
    """The report's precision line for the roles on FSDP."""
    roles = [r for r, e in engine_roles(cfg).items() if e == ENGINE]
    dp = role_layouts(cfg)[roles[0]].dp
    compute = ("computes in bf16: each unit all-gathered in bf16 from the fp32 shards (MixedPrecisionPolicy), its "
               "gradients reduce-scattered in fp32" if dtype == "bf16"
               else "computes in fp32 on each unit's all-gathered parameters")
    offload = "; shards, gradients and moments in host memory (actor.fsdp.cpu_offload)" \
        if cfg.actor.fsdp.cpu_offload and device == "gpu" else ""
    return (f"FSDP ({', '.join(roles)}): fp32 weight shards over the {dp} DP ranks, which are the masters (no "
            f"separate copy); {compute}; fp32 gradient shards while updating; Adam moments 2 x fp32 shards (always "
            f"cut over DP: actor.optim.shard_over_dp does not apply){offload}")


RECOMPUTE_MEANING = {
    "none": "no activation checkpointing (actor.recompute=none)",
    "full": "activation checkpointing (actor.recompute=full: HF gradient checkpointing, each layer's input kept, "
            "the layer re-run in the backward)",
}


def activation_line(est: Any, cfg: DictConfig) -> str:
    """The report's activations line for an FSDP actor."""
    reshard = ("" if cfg.actor.fsdp.reshard_after_forward
               else "; every layer stays gathered from its forward to its backward (reshard_after_forward=false)")
    if cfg.actor.fsdp.accumulate_unsharded:
        reshard += ("; every layer gathered and every gradient unsharded over a step's micro-batches, one "
                    "reduce-scatter per step (accumulate_unsharded)")
    impl = attention(cfg, est.device == "gpu")
    attends = (f"attention {impl or 'sdpa'} under a block-diagonal mask (prompts shared)" if takes_block_mask(impl)
               else f"attention {impl} over packed rows by position_ids (no mask; each sequence whole)")
    return (f"micro-batches of up to {est.micro_batch_tokens} tokens (actor: laid out as for Megatron, "
            f"packed or padded rows), one at a time (FSDP, no pipeline); {attends} "
            f"(actor.fsdp.attn_implementation); {RECOMPUTE_MEANING.get(est.recompute, est.recompute)}{reshard}")


def suggestions(cfg: DictConfig, device: str) -> list[tuple[dict[str, Any], str]]:
    """Changes of the FSDP engine's own keys for suggest.py to try: (changes, kind)."""
    if ENGINE not in engine_roles(cfg).values():
        return []
    out: list[tuple[dict[str, Any], str]] = []
    if not cfg.actor.fsdp.reshard_after_forward:
        out.append(({"actor.fsdp.reshard_after_forward": True}, "FSDP reshard"))
    if cfg.actor.fsdp.accumulate_unsharded:
        out.append(({"actor.fsdp.accumulate_unsharded": False}, "FSDP reshard"))
    if device == "gpu" and not cfg.actor.fsdp.cpu_offload:
        out.append(({"actor.fsdp.cpu_offload": True}, "FSDP offload"))
    return out
