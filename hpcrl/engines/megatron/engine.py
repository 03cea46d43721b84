"""One rank's share of a Megatron-core model role: build, load HF weights, forward for log-probs
or values, PPO-family updates, export back to HF.

The engine is launch-agnostic: it needs torch.distributed initialised among the worker ranks and
megatron's parallel_state set up for its layout (see `init_model_parallel`); the worker-group
methods of the controller runtime call into it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.engines.megatron.attention import segments_of
from hpcrl.engines.megatron.convert import SafetensorsReader, hf_to_megatron, megatron_to_hf
from hpcrl.engines.megatron.cpu_compat import apply_cpu_compat
from hpcrl.engines.megatron.lora import (
    LoraSettings,
    LoraState,
    MergedShard,
    adapters_from_hf,
    apply_lora,
    read_peft_folder,
)
from hpcrl.engines.megatron.model import ModelArch, build_gpt_model, read_arch
from hpcrl.engines.megatron.optim_shards import OptimizerShards
from hpcrl.engines.megatron.packing import (
    PackedMicroBatch,
    Unit,
    pack,
    plan_micro_batches,
    plan_padded_micro_batches,
    shared_prefix_units,
    shares_prefixes,
    unit_length,
    unpack_token_values,
)

log = logging.getLogger("hpcrl.engine")


# The process groups the last `init_model_parallel` created on this rank, destroyed by the next one.
_megatron_groups: list[Any] = []


def init_model_parallel(tp: int, pp: int, seed: int = 1234, timeout_minutes: int = 10) -> None:
    """Megatron's process groups over the already-initialised torch.distributed world.

    Rank order is megatron's default (tp-cp-ep-dp-pp): TP varies fastest, then DP, then PP.
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
                                 distributed_timeout_minutes=timeout_minutes, create_gloo_process_groups=False)
    _megatron_groups[:] = [g for g in registry if g not in before]
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


class ValueHead(torch.nn.Module):
    """Scalar value per position, in place of the vocab-parallel output layer (critic role).

    Replicated on every TP rank: its input is replicated there, so its gradients agree without
    any reduction, like a norm weight."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


@dataclass
class OptimSettings:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    total_steps: int = 1000
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    # each DP rank keeps and steps the AdamW state (and fp32 masters) of its share of the parameters
    # only (hpcrl.engines.megatron.optim_shards); the updates are the same either way
    shard_over_dp: bool = True


def lr_factor(step: int, s: OptimSettings) -> float:
    """Multiplier of the base LR at optimizer step `step` (warmup, then the schedule to min_lr)."""
    if s.warmup_steps and step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.lr_schedule == "constant":
        return 1.0
    span = max(s.total_steps - s.warmup_steps, 1)
    progress = min(max(step - s.warmup_steps, 0) / span, 1.0)
    floor = s.min_lr / s.lr if s.lr else 0.0
    if s.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    import math
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


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
    extra: dict[str, Any] = field(default_factory=dict)


def thd_params(mb: PackedMicroBatch, device: Any):
    """Transformer Engine's packed-sequence description of a one-row micro-batch: cumulative
    sequence boundaries (the tail padding is one more segment), so attention and RoPE restart at
    every sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for p in mb.placement:
        assert not p.start, "Transformer Engine's packed attention cannot share a prefix"
        bounds.append(p.offset + p.length)
    if bounds[-1] < mb.tokens.shape[1]:
        bounds.append(mb.tokens.shape[1])
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def square_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the squares of a tensor's entries, as a float64 scalar, at float32 speed: fp32 norms
    of rows of 1024 entries (each accurate to float rounding), summed in float64. Why: a float64
    copy of every gradient took 1.2 s per optimizer step for a 135M model on one core, and one fp32
    norm over a 28M-entry tensor was off by 7e-4 (relative); this takes 0.07 s, off by ~1e-9."""
    flat = t.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    whole = flat.numel() // 1024 * 1024
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, 1024), dim=1).double().square().sum()
    return rows + flat[whole:].double().square().sum()


class MegatronEngine:
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
        use_te = False if self.options.lora is not None else self.options.use_te
        self.model = build_gpt_model(self.arch, self.options.dtype, use_te, self.options.attention)
        self.spec = self.model.hpcrl_spec
        if value_head and self.model.post_process:
            self.model.output_layer = ValueHead(self.arch.hidden_size, self.options.dtype).to(
                next(self.model.parameters()).device)
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
            # (fewer tensors than DP ranks would leave a rank with nothing to step: not cut then)
            if optim.shard_over_dp and 1 < self.dp_size <= len(self.trainable):
                self.shards = OptimizerShards([p.numel() for p in self.trainable], ps.get_data_parallel_group())
            owned = [self.steps_here(i) for i in range(len(self.trainable))]
            params = [p for p, mine in zip(self.trainable, owned, strict=True) if mine]
            if self.options.dtype != torch.float32:
                self.master = [torch.nn.Parameter(p.detach().float().clone()) if mine else None
                               for p, mine in zip(self.trainable, owned, strict=True)]
                self._add_fp32_grad_buffers(list(self.trainable))
                params = [m for m in self.master if m is not None]
            # fused: one pass over each tensor instead of one per arithmetic op (CPU and CUDA). On the
            # demo model, one core: 0.92 s -> 0.18 s per optimizer step (measured), the same updates
            # up to float rounding.
            self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                               weight_decay=optim.weight_decay, fused=True)

    def _add_fp32_grad_buffers(self, params: list[torch.nn.Parameter]) -> None:
        """Low-precision models sum their micro-batch gradients into fp32 `main_grad` buffers (as
        megatron's DDP does): each backward's bf16 gradient is added once and dropped, so rounding
        does not compound over micro-batches, and the masters step with an fp32 gradient."""
        def accumulate(p: torch.nn.Parameter) -> None:
            p.main_grad.add_(p.grad)
            p.grad = None

        for p in params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.register_post_accumulate_grad_hook(accumulate)

    def steps_here(self, index: int) -> bool:
        """Whether this rank keeps the optimizer state of trainable parameter `index` and steps it."""
        return self.shards is None or self.shards.owns(index)

    def optimizer_param(self, index: int) -> torch.nn.Parameter | None:
        """What the optimizer steps for trainable parameter `index` (its fp32 master, or itself); None
        where another DP rank steps it."""
        if not self.steps_here(index):
            return None
        return self.master[index] if self.master is not None else self.trainable[index]

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state and fp32 masters this rank holds."""
        state = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)] \
            if self.optimizer is not None else []
        masters = [m for m in self.master or [] if m is not None]
        return sum(t.numel() * t.element_size() for t in state + masters)

    def gather_optimizer_state(self) -> dict[int, dict[str, torch.Tensor]] | None:
        """With the state sharded over DP (collective over the DP group): on DP rank 0, the optimizer
        state of the trainable parameters other ranks step, by index, with their fp32 master under
        "master"; None on the other ranks, and everywhere when this rank steps every parameter."""
        if self.shards is None or self.optimizer is None:
            return None
        local: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(len(self.trainable)):
            q = self.optimizer_param(i)
            if q is None:
                continue
            state = self.optimizer.state.get(q, {})
            odd = [k for k, v in state.items() if not torch.is_tensor(v)]
            if odd:
                raise ValueError(f"optimizer state {odd} is not a tensor: it cannot be gathered over DP; "
                                 "set actor.optim.shard_over_dp=false")
            local[i] = {**state, **({"master": self.master[i]} if self.master is not None else {})}
        every = self.shards.gather_to_first(local)
        return None if every is None else {i: v for i, v in every.items() if not self.steps_here(i)}

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient the optimizer steps with: fp32 `main_grad` with masters, else `.grad`."""
        return p.main_grad if self.master is not None else p.grad

    def _zero_grads(self) -> None:
        """Clear the model's gradients (not only the optimizer's parameters: with masters those
        are the fp32 copies, and a stale model gradient would be added into the next step)."""
        for p in self.trainable:
            p.grad = None
            if self.master is not None:
                p.main_grad.zero_()

    def _select_output_positions(self) -> None:
        """Let the vocabulary projection run only at the positions a micro-batch asks for
        (`self._positions`): the hidden states there, [n, 1, h] in [T, B] order, instead of all
        [T, B, h]. Log-probs and losses are needed at response tokens only, and the projection and
        the log-softmax over the vocabulary cost about a fifth of a small model's compute and its
        largest activations. Not with sequence parallelism (the output layer's input is split)."""
        if not self.model.post_process or self.value_head or self.model.config.sequence_parallel:
            return
        layer = self.model.output_layer
        project = layer.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._positions is not None:
                hidden_states = hidden_states[self._positions.t().to(hidden_states.device)].unsqueeze(1)
            return project(hidden_states, *args, **kwargs)

        layer.forward = forward

    def _positions_drive_rope(self) -> bool:
        """RoPE at each token's own position (`self._rope["positions"]`) instead of its place in the
        packed row. megatron rotates by row place, which is exact for sequences laid out one after
        another (RoPE sees only relative positions), but not for the branches of a shared prefix,
        which follow each other in the row while each continues the prefix. False where the model
        has no megatron RotaryEmbedding (nothing is changed then)."""
        rope = getattr(self.model, "rotary_pos_emb", None)
        if rope is None or type(rope).__name__ != "RotaryEmbedding":
            return False
        by_place = rope.forward
        # The wrapper must not refer to the engine: megatron's RotaryEmbedding.forward is an
        # lru_cache over its module, which would keep the engine, its model and process groups
        # (each with gloo threads) alive after the engine is dropped.
        state = self._rope

        def forward(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            if state["positions"] is None:
                return by_place(max_seq_len, *args, **kwargs)
            pos = state["positions"].t()  # [T, B]
            emb = by_place(int(pos.max()) + 1, *args, **kwargs)  # [S, 1, 1, d]
            return emb[:, 0, 0][pos.to(emb.device)].unsqueeze(2)  # [T, B, 1, d]

        rope.forward = forward
        return True

    def _spread(self, values: torch.Tensor, mb: PackedMicroBatch) -> torch.Tensor:
        """Per-position values of the selected positions ([1, n], see `_select_output_positions`)
        back to [B, T] with zeros elsewhere (differentiable); [B, T] values pass through."""
        if self._positions is None:
            return values
        sel = self._positions.t().to(values.device)
        return torch.zeros(sel.shape, dtype=values.dtype, device=values.device).masked_scatter(
            sel, values.reshape(-1)).t()

    def _labels(self, mb: PackedMicroBatch, device: Any) -> torch.Tensor:
        """The labels of the positions whose logits the output layer computed, shaped like them."""
        labels = mb.labels.to(device)
        if self._positions is None:
            return labels
        return labels.t()[self._positions.t().to(device)][None]

    # weights -----------------------------------------------------------------------------------
    def load_hf(self, model_path: str) -> None:
        """Load this shard from a HF folder, reading only the tensors it needs."""
        reader = SafetensorsReader(model_path)
        shard = hf_to_megatron(self.arch, reader, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size,
                               self.spec, lm_head=not self.value_head)
        if self.value_head and self.model.post_process:
            # a fresh head: the LM head's weights are not values
            shard.update({f"output_layer.{k}": v for k, v in self.model.output_layer.state_dict().items()})
        self.load_megatron_shard(shard)

    def load_megatron_shard(self, shard: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        params = {k for k in own if not k.endswith("_extra_state")}
        missing, unexpected = params - shard.keys(), shard.keys() - params
        if missing or unexpected:
            raise RuntimeError(f"weight shard does not fit the model: missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]}")
        with torch.no_grad():
            for k, v in shard.items():
                if own[k].shape != v.shape:
                    raise RuntimeError(f"{k}: checkpoint shape {tuple(v.shape)} != model {tuple(own[k].shape)}")
                own[k].copy_(v)

    def megatron_shard(self) -> Mapping[str, torch.Tensor]:
        """This rank's weights, megatron-named. With LoRA: the base names, adapted layers merged
        (W + scale B A, computed on access: see hpcrl.engines.megatron.lora.MergedShard)."""
        if self.lora is not None:
            return MergedShard(self.model, self.lora)
        return {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    def shard_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each `megatron_shard` tensor, without reading (or merging) any."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict(keep_vars=True).items()
                if not k.endswith("_extra_state") and ".lora_" not in k}

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of what the optimizer steps, in its order: what a checkpoint holds."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def adapter_shard(self) -> dict[str, torch.Tensor]:
        """This rank's LoRA tensors (megatron names `...<layer>.lora_A|B`)."""
        assert self.lora is not None, "engine built without LoRA"
        return {k: v.detach() for k, v in self.lora.adapter_params().items()}

    def load_adapters_peft(self, path: str) -> None:
        """Set the adapters from a PEFT LoRA folder (its rank must be actor.lora.rank)."""
        assert self.lora is not None, "engine built without LoRA"
        cfg, get = read_peft_folder(path)
        s = self.lora.settings
        if int(cfg.get("r", -1)) != s.rank or float(cfg.get("lora_alpha", -1)) != float(s.alpha):
            raise ValueError(f"{path}: adapter rank {cfg.get('r')} / alpha {cfg.get('lora_alpha')}, but "
                             f"actor.lora has rank {s.rank} / alpha {s.alpha}")
        shard = adapters_from_hf(self.arch, get, s.targets, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)
        own = self.lora.adapter_params()
        with torch.no_grad():
            for k, v in shard.items():
                if own[k].shape != v.shape:
                    raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the model's adapter "
                                     f"{tuple(own[k].shape)}")
                own[k].copy_(v)

    def export_hf_stage(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """Gather the TP shards of this pipeline stage; TP rank 0 gets the stage's HF tensors.

        `tensors` (Megatron-named, laid out like the shard: e.g. recorded gradients) replaces the
        weights; a critic's value head comes back as value_head.weight / value_head.bias."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        source = self.megatron_shard() if tensors is None else tensors
        head = {k.replace("output_layer.", "value_head."): v.detach().cpu() for k, v in source.items()
                if self.value_head and k.startswith("output_layer.")}
        mine = {k: v.detach().cpu() for k, v in source.items() if not k.startswith("output_layer.")
                or not self.value_head}
        if self.tp_size == 1:
            gathered = [mine]
        else:
            gathered = [None] * self.tp_size
            dist.all_gather_object(gathered, mine, group=ps.get_tensor_model_parallel_group())
            if self.tp_rank != 0:
                return None
        out = megatron_to_hf(self.arch, gathered, self.pp_rank, self.pp_size, self.spec)
        if tensors is not None:
            out.update(head)  # the weights' export (HF folders) has no place for a value head
        return out

    # device memory -----------------------------------------------------------------------------
    def offload(self) -> bool:
        """Move parameters, gradients and optimizer state to pinned host memory, so the colocated
        rollout engine can use the device memory. No-op (False) without CUDA."""
        return self._move("cpu")

    def onload(self) -> bool:
        """Bring everything `offload` moved back onto this rank's GPU."""
        return self._move(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")

    def _move(self, device: str) -> bool:
        if not torch.cuda.is_available():
            return False

        def to(t: torch.Tensor) -> torch.Tensor:
            if device == "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                return host.copy_(t.detach(), non_blocking=True)
            return t.to(device, non_blocking=True)

        for p in self.model.parameters():
            p.data = to(p.data)
            p.grad = None  # gradients are dead between steps
            if hasattr(p, "main_grad"):
                p.main_grad = to(p.main_grad)
        for m in self.master or []:
            if m is not None:
                m.data = to(m.data)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        state[k] = to(v)
        torch.cuda.synchronize()
        if device == "cpu":
            torch.cuda.empty_cache()
        return True

    # forward -----------------------------------------------------------------------------------
    def _micro_batches(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None = None
                       ) -> list[PackedMicroBatch]:
        lengths = [int(s.numel()) for s in seqs]
        if self.options.packing:
            units = self._units(seqs, token_fields)
            groups = plan_micro_batches([unit_length(u, lengths) for u in units], self.options.micro_batch_tokens)
            rows_of = [[[units[u] for u in g]] for g in groups]  # one packed row per micro-batch
        else:
            groups = plan_padded_micro_batches(len(seqs), self.options.micro_batch_size)
            # a short last micro-batch gets empty rows: every micro-batch must have one shape
            rows_of = [[[i] for i in g] + [[]] * (self.options.micro_batch_size - len(g)) for g in groups]

        def longest_row(rows: list[list[Unit]]) -> int:
            return max(sum(unit_length(u, lengths) for u in row) for row in rows)

        # pipeline stages exchange fixed-size activations: with PP every micro-batch has one shape;
        # without PP each is only as long as its longest row
        common = max(longest_row(rows) for rows in rows_of)
        dense = self.model.hpcrl_attention == "dense"
        return [pack(seqs, rows, common if self.pp_size > 1 else longest_row(rows), token_fields, dense_mask=dense)
                for rows in rows_of]

    def _units(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None) -> list[Unit]:
        """What the packed rows hold: the sequences, with the samples of one prompt sharing it
        when only later positions carry a loss or a requested output (`share_prompt`)."""
        fields = token_fields or {}
        needed = fields.get("loss_weight", fields.get("positions"))
        # the local spec's attention takes the branch layout (TE's packed attention does not), and a
        # branch needs RoPE at its tokens' own positions (another position embedding: no sharing)
        shares = self.options.share_prompt and self.spec == "local" and self._rope_by_position
        if not shares or needed is None:
            return list(range(len(seqs)))
        first = []
        for v in needed:
            nz = torch.nonzero(v).flatten()
            first.append(int(nz[0]) if nz.numel() else 0)
        return shared_prefix_units(seqs, first, self.options.micro_batch_tokens)

    def _run(self, mbs: list[PackedMicroBatch], loss_fn: Callable, forward_only: bool,
             positions: Callable[[PackedMicroBatch], torch.Tensor | None] | None = None) -> list[Any]:
        """megatron's forward(-backward) over the micro-batches; positions(mb) -> the [B, T] bool
        mask of the positions whose logits are needed (None: all)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

        te = self.spec == "te"

        def forward_step(it: Iterator[PackedMicroBatch], model: torch.nn.Module):
            mb = next(it)
            # read by the output layer of this micro-batch's forward and by its loss function
            self._positions = positions(mb) if positions is not None else None
            self._rope["positions"] = mb.position_ids if shares_prefixes(mb) else None
            tokens, positions_ids = mb.tokens.to(device), mb.position_ids.to(device)
            if not te:  # local spec: the sequences' segments (or the dense block mask) carry the packing
                mask = (mb.attention_mask if mb.attention_mask is not None
                        else segments_of(mb.placement, mb.tokens.shape[0]))
                out = model(tokens, positions_ids, mask.to(device))
            elif len(mb.placement) > mb.tokens.shape[0]:  # TE, packed: THD layout with per-sequence RoPE
                out = model(tokens, positions_ids, None, packed_seq_params=thd_params(mb, device))
            else:  # TE, one right-padded sequence per row: plain causal attention is exact
                out = model(tokens, positions_ids, None)
            selected = self._positions

            def loss(output: torch.Tensor) -> Any:
                self._positions = selected  # with PP the loss runs after other micro-batches' forwards
                return loss_fn(output, mb)

            return out, loss

        b, t = mbs[0].tokens.shape
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=self.model,
            num_microbatches=len(mbs), seq_length=t, micro_batch_size=b, forward_only=forward_only)

    def token_logprobs(self, logits: torch.Tensor, mb: PackedMicroBatch, temperature: float = 1.0) -> torch.Tensor:
        """log p(label) per position from vocab-parallel logits [B, T, V/TP] -> [B, T], under the
        distribution softmax(logits / temperature): the one a rollout at that temperature samples."""
        from megatron.core import tensor_parallel

        # Always a new tensor (also for fp32 at T=1): megatron's cross entropy overwrites its input
        # in place (minus the max, then exp, kept as the softmax for backward), and the entropy
        # reads the model's output after it.
        logits = logits.float() / temperature
        vocab_per_rank = logits.shape[-1]
        start = self.tp_rank * vocab_per_rank
        if start + vocab_per_rank > self.arch.vocab_size:  # padded vocab rows are not tokens
            logits[..., max(self.arch.vocab_size - start, 0):] = float("-inf")
        labels = self._labels(mb, logits.device)
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.t().contiguous())
        return self._spread(-nll.t(), mb)

    def _forward_collect(self, seqs: list[torch.Tensor],
                         per_token: Callable[[torch.Tensor, PackedMicroBatch], torch.Tensor],
                         positions: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Forward only; per_token(output, micro-batch) -> [B, T] values laid out like labels, cut
        back into one tensor per sequence. Returned on the last pipeline stage, None elsewhere."""
        self.model.eval()

        def loss_fn(output: torch.Tensor, mb: PackedMicroBatch):
            v = per_token(output, mb)
            return v.sum() * 0.0, torch.tensor(1), {"values": v.detach().cpu(), "mb": mb}

        fields = {"positions": [p.float() for p in positions]} if positions is not None else None
        select = (lambda mb: mb.extra["positions"].bool() & mb.label_mask.bool()) if positions is not None else None
        store = self._run(self._micro_batches(seqs, fields), loss_fn, forward_only=True, positions=select)
        if not store:
            return None
        out: dict[int, torch.Tensor] = {}
        for item in store:
            out.update(unpack_token_values(item["values"], item["mb"]))
        return [out[i].clone() for i in range(len(seqs))]

    @torch.no_grad()
    def compute_values(self, seqs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per-position values (entry t: the state seq[:t+1]) from the value head; last stage only."""
        assert self.value_head, "compute_values needs an engine built with value_head=True"
        return self._forward_collect(seqs, lambda output, mb: output[..., 0].float())

    @torch.no_grad()
    def compute_logprob(self, seqs: list[torch.Tensor], temperature: float = 1.0,
                        positions: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Per-token log-probs of each sequence (entry t: log p(seq[t+1] | seq[:t+1])) under
        softmax(logits / temperature); with positions (per sequence, label-aligned bool), only
        there (0 elsewhere: the output layer skips the other positions).

        Returned on the last pipeline stage (every TP rank of it); other stages return None."""
        return self._forward_collect(seqs, lambda output, mb: self.token_logprobs(output, mb, temperature),
                                     positions)

    def token_entropy(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of softmax(logits / temperature) over the full vocabulary per position, from
        vocab-parallel logits."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        vocab_per_rank = logits.shape[-1]
        start = self.tp_rank * vocab_per_rank
        if start + vocab_per_rank > self.arch.vocab_size:
            logits = logits.clone()
            logits[..., max(self.arch.vocab_size - start, 0):] = float("-inf")
        with torch.no_grad():
            m = logits.max(dim=-1, keepdim=True).values
            if self.tp_size > 1:
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX,
                                             group=ps.get_tensor_model_parallel_group())
        e = torch.exp(logits - m)
        z = reduce_from_tensor_model_parallel_region(e.sum(-1))
        ez = reduce_from_tensor_model_parallel_region(torch.nan_to_num(e * (logits - m)).sum(-1))
        return torch.log(z) - ez / z  # [B, T], or [1, n] at the selected positions (see _spread)

    # training ----------------------------------------------------------------------------------
    def train_step(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]],
                   loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
                   need_entropy: bool = False, temperature: float = 1.0, entropy_grad: bool = True
                   ) -> dict[str, float]:
        """One optimizer step over this rank's part of a mini-batch.

        loss_fn(output, entropy, fields) gets per-token log-probs (actor; under softmax(logits /
        temperature)) or values (critic) laid out like labels, and returns (weighted loss sum,
        metric sums). The weights in `token_fields` are normalised over the whole mini-batch, so
        gradients are summed (not averaged) over DP."""
        assert self.optimizer is not None and self.optim is not None, "engine built without an optimizer"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._zero_grads()
        if self.lora is not None:
            self.lora.begin_step()
        mbs = self._micro_batches(seqs, token_fields)

        def micro_loss(output: torch.Tensor, mb: PackedMicroBatch):
            if self.value_head:
                out = output[..., 0].float()
                entropy = None
            else:
                out = self.token_logprobs(output, mb, temperature)
                entropy = None
                if need_entropy:
                    # a metric only (entropy_grad=False): no graph, so no [tokens, vocab] tensors kept
                    # for a backward that never comes
                    with torch.set_grad_enabled(entropy_grad):
                        entropy = self._spread(self.token_entropy(output if entropy_grad else output.detach(),
                                                                  temperature), mb)
            fields = {k: v.to(out.device) for k, v in mb.extra.items()}
            fields["label_mask"] = mb.label_mask.to(out.device)
            loss, metrics = loss_fn(out, entropy, fields)
            return loss, torch.tensor(1, dtype=torch.int), {k: v.detach().float().cpu() for k, v in
                                                            {"loss": loss, **metrics}.items()}

        # the actor's logits only where a loss weight is (response tokens of the mini-batch)
        select = (None if self.value_head or "loss_weight" not in (token_fields or {})
                  else lambda mb: (mb.extra["loss_weight"] > 0) & mb.label_mask.bool())
        store = self._run(mbs, micro_loss, forward_only=False, positions=select)
        self._positions = None
        self._finish_grads()
        if self.record_grads is not None:
            self.record_grads.append({n: self._grad(p).detach().float().clone()
                                      for n, p in self.named_trainable()})
        grad_norm = self._clip_grads(self.optim.clip_grad)
        # A NaN/Inf loss or gradient would write NaN weights and Adam moments: skip the step. The
        # norm is global (DP-reduced gradients, summed over TP and PP), so all ranks skip alike.
        finite = math.isfinite(grad_norm)
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = self.optim.lr * lr_factor(self.step_count, self.optim)
            if self.master is not None:
                for p, m in zip(self.trainable, self.master, strict=True):
                    if m is not None:
                        m.grad = p.main_grad  # fp32 already: the masters step with it, no copy
            self.optimizer.step()
            if self.master is not None:
                with torch.no_grad():
                    for p, m in zip(self.trainable, self.master, strict=True):
                        if m is not None:
                            p.copy_(m)
            if self.shards is not None:
                self.shards.broadcast_stepped(self.trainable)
            self.step_count += 1
        else:
            log.warning("rank %d: optimizer step %d skipped, gradient norm %s (%d in a row)",
                        torch.distributed.get_rank(), self.step_count + 1, grad_norm, self.nonfinite_in_a_row)
        # the next step starts from none: without masters the gradients would otherwise stay
        # allocated (a model's size) through the rollout that follows the update
        for p in self.model.parameters():
            p.grad = None
        for m in self.master or []:
            if m is not None:
                m.grad = None  # an alias of main_grad, which stays (zeroed by the next step)
        return {**self._sum_metrics(store), "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                "nonfinite_skipped": float(not finite), "nonfinite_in_a_row": float(self.nonfinite_in_a_row)}

    def _sum_metrics(self, store: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Metric sums over micro-batches, DP ranks and (from the last stage) the pipeline; metrics
        named *_max are maxima instead."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        keys_holder = [sorted(store[0]) if store else []]
        dist.broadcast_object_list(keys_holder, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = keys_holder[0]
        is_max = torch.tensor([k.endswith("_max") for k in keys], dtype=torch.bool)
        vec = torch.zeros(len(keys), dtype=torch.float64)
        for item in store:
            vals = torch.tensor([float(item[k]) for k in keys], dtype=torch.float64)
            vec = torch.where(is_max, torch.maximum(vec, vals), vec + vals)
        last, pp_group = ps.get_pipeline_model_parallel_last_rank(), ps.get_pipeline_model_parallel_group()
        dist.broadcast(vec, src=last, group=pp_group)
        sums, maxes = vec.clone(), vec.clone()
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return dict(zip(keys, torch.where(is_max, maxes, sums).tolist(), strict=True))

    def _finish_grads(self) -> None:
        """Sum gradients over DP, and tie the embedding's two copies when PP splits them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        params = self.trainable
        for p in params:
            if self._grad(p) is None:
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:
            # Each gradient in place, all queued at once: no flat copy. A fresh flat buffer of the
            # model's size is a model's worth of page faults per step on CPU: flattening the demo
            # model's 540 MB of gradients took 1.5 s of its 2 workers' optimizer steps (py-spy).
            group = ps.get_data_parallel_group()
            for work in [dist.all_reduce(self._grad(p), group=group, async_op=True) for p in params]:
                work.wait()
        if self.arch.tie_word_embeddings and self.pp_size > 1 and ps.is_rank_in_embedding_group():
            w = self.model.shared_embedding_or_output_weight()
            if w.requires_grad:  # frozen under LoRA
                dist.all_reduce(self._grad(w), group=ps.get_embedding_group())

    def _clip_grads(self, max_norm: float) -> float:
        """Global L2 norm over the model's true parameters: TP shards summed over TP, replicated
        tensors counted once, pipeline stages summed, the tied output copy skipped."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        sharded = torch.zeros(1, dtype=torch.float64)
        replicated = torch.zeros(1, dtype=torch.float64)
        tied_copy = (self.model.output_layer.weight if self.arch.tie_word_embeddings and self.pp_size > 1
                     and not self.model.pre_process and self.model.post_process else None)
        for p in self.trainable:
            if self._grad(p) is None or p is tied_copy:
                continue
            sq = square_sum(self._grad(p))
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        total = sharded + replicated
        if self.pp_size > 1:
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        norm = float(total.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.trainable:
                if self._grad(p) is not None:
                    self._grad(p).mul_(scale)
        return norm
