"""The engine's forward passes: micro-batches packed from sequences (shared prompt prefixes included),
megatron's forward(-backward) schedule over them, the output layer run only at the positions needed,
RoPE at each token's own position, and per-token log-probs, entropies and values.

`ForwardMixin` is part of `MegatronEngine` (hpcrl.engines.megatron.engine), which sets the attributes
it reads: `model`, `options`, `spec`, `arch`, `value_head`, `tp_rank`, `tp_size`, `pp_size`,
`_positions`, `_rope`, `_rope_by_position`, `cp_rank`, `cp_size`.

Context parallel (hpcrl.engines.megatron.context_parallel): a micro-batch is packed whole, every
sequence padded to 2 x CP places, and each CP rank runs its part; per-token results are gathered
back over the CP group. Sequence parallel: a row's length is a multiple of TP (megatron scatters the
sequence over the TP ranks between the tensor-parallel layers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch

from hpcrl.engines.megatron.attention import segments_of
from hpcrl.engines.megatron.context_parallel import gather_row_values, local_part, padded_length
from hpcrl.engines.megatron.moe import routers, set_micro_batch_loss_scale
from hpcrl.engines.megatron.packing import (
    PackedMicroBatch,
    Unit,
    pack,
    packing_units,
    plan_micro_batches,
    plan_padded_micro_batches,
    shares_prefixes,
    unit_length,
    unpack_token_values,
)
from hpcrl.engines.megatron.routing_replay import ReplayRouting, layout_routes, local_places, unlayout_routes


def thd_params(mb: PackedMicroBatch, device: Any, cp: int = 1):
    """Transformer Engine's packed-sequence description of a one-row micro-batch: cumulative
    sequence boundaries (the tail padding is one more segment), so attention and RoPE restart at
    every sequence. With CP: of the whole row (a CP part's `full`), real and padded lengths, as TE's
    context-parallel attention takes them (each rank holds chunks r and 2 x CP - 1 - r of every
    sequence, the layout of hpcrl.engines.megatron.context_parallel)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cp > 1:
        full = mb.full
        if full.tokens.shape[0] != 1:
            raise ValueError("context parallel with Transformer Engine needs packed micro-batches (actor.packing)")
        real, padded = [0], [0]
        for p in sorted(full.placement, key=lambda p: p.offset):
            real.append(real[-1] + p.length)
            padded.append(padded[-1] + padded_length(p.length, cp))
        if padded[-1] < full.tokens.shape[1]:  # the tail padding: a sequence of its own
            real.append(real[-1] + full.tokens.shape[1] - padded[-1])
            padded.append(full.tokens.shape[1])
        cu, cu_padded = (torch.tensor(x, dtype=torch.int32, device=device) for x in (real, padded))
        longest = int((cu_padded[1:] - cu_padded[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                               cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest)
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


class ForwardMixin:
    """The forward part of `MegatronEngine`."""

    def _select_output_positions(self) -> None:
        """Let the vocabulary projection run only at the positions a micro-batch asks for
        (`self._positions`): the hidden states there, [n, 1, h] in [T, B] order, instead of all
        [T, B, h]. Log-probs and losses are needed at response tokens only, and the projection and
        the log-softmax over the vocabulary cost about a fifth of a small model's compute and its
        largest activations. Not with sequence parallelism (the output layer's input is split)."""
        self._selects_positions = False
        if not self.model.post_process or self.value_head or self.model.config.sequence_parallel:
            return
        self._selects_positions = True
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
            # packed_seq: the whole table, never megatron's CP slice of it (positions pick the rows)
            emb = by_place(int(pos.max()) + 1, *args, **{**kwargs, "packed_seq": True})  # [S, 1, 1, d]
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

    def _micro_batches(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None = None
                       ) -> list[PackedMicroBatch]:
        cp = self.cp_size
        # places a sequence takes in a row: with CP a multiple of 2 x CP (its chunks)
        lengths = [int(s.numel()) if cp == 1 else padded_length(int(s.numel()), cp) for s in seqs]
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
        # a row's length: a multiple of 2 x CP (whole chunks) and, with SP, its CP part a multiple of TP
        multiple = (2 * cp if cp > 1 else 1) * (self.tp_size if self.model.config.sequence_parallel else 1)

        def row_length(n: int) -> int:
            return -(-n // multiple) * multiple

        common = max(longest_row(rows) for rows in rows_of)
        dense = self.model.hpcrl_attention == "dense"
        mbs = [pack(seqs, rows, row_length(common if self.pp_size > 1 else longest_row(rows)), token_fields,
                    dense_mask=dense, align=2 * cp if cp > 1 else 1) for rows in rows_of]
        return mbs if cp == 1 else [local_part(mb, cp, self.cp_rank) for mb in mbs]

    def _units(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None) -> list[Unit]:
        """What the packed rows hold (`packing_units`): prompts shared when `share_prompt` and the
        layout allow it."""
        # the local spec's attention takes the branch layout (TE's packed attention does not), and a
        # branch needs RoPE at its tokens' own positions (another position embedding: no sharing)
        # (nor with CP: a rank's chunks of a branch would need its prefix's chunks on other ranks)
        shares = self.options.share_prompt and self.spec == "local" and self._rope_by_position and self.cp_size == 1
        return packing_units(seqs, token_fields, self.options.micro_batch_tokens, shares)

    def _run(self, mbs: list[PackedMicroBatch], loss_fn: Callable, forward_only: bool,
             positions: Callable[[PackedMicroBatch], torch.Tensor | None] | None = None) -> list[Any]:
        """megatron's forward(-backward) over the micro-batches; positions(mb) -> the [B, T] bool
        mask of the positions whose logits are needed (None: all)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

        te = self.spec == "te"
        replay = self._replay_routing()

        def forward_step(it: Iterator[PackedMicroBatch], model: torch.nn.Module):
            mb = next(it)
            if replay is not None and self.routes is not None:  # the recorded experts at this rank's tokens
                places = layout_routes(getattr(mb, "full", None) or mb, self.routes)
                sp = self.tp_size if self.model.config.sequence_parallel else 1
                replay.set_micro_batch(local_places(places, mb, self.tp_rank, sp))
            # read by the output layer of this micro-batch's forward and by its loss function
            # (where the output layer runs at every position, e.g. under SP, the callers mask instead)
            self._positions = positions(mb) if positions is not None and self._selects_positions else None
            # with CP a rank's tokens are chunks from all over each sequence: RoPE by their positions
            # (TE's THD path rotates each sequence's chunks itself, from the cumulative lengths)
            self._rope["positions"] = mb.position_ids if shares_prefixes(mb) or (self.cp_size > 1 and not te) else None
            tokens, positions_ids = mb.tokens.to(device), mb.position_ids.to(device)
            if self.arch.is_moe and not forward_only:
                share = float(mb.extra["loss_weight"].sum()) if "loss_weight" in mb.extra else 1.0 / len(mbs)
                local_tokens = mb.tokens.numel() // (self.tp_size if self.model.config.sequence_parallel else 1)
                set_micro_batch_loss_scale(self.model, self.options.moe, share, local_tokens)
            if not te:  # local spec: the sequences' segments (or the dense block mask) carry the packing
                mask = (mb.attention_mask if mb.attention_mask is not None
                        else segments_of(mb.placement, mb.tokens.shape[0]))
                out = model(tokens, positions_ids, mask.to(device))
            elif len(mb.placement) > mb.tokens.shape[0] or self.cp_size > 1:  # TE, packed: THD, per-sequence RoPE
                out = model(tokens, positions_ids, None, packed_seq_params=thd_params(mb, device, self.cp_size))
            else:  # TE, one right-padded sequence per row: plain causal attention is exact
                out = model(tokens, positions_ids, None)
            selected = self._positions

            def loss(output: torch.Tensor) -> Any:
                self._positions = selected  # with PP the loss runs after other micro-batches' forwards
                return loss_fn(output, mb)

            return out, loss

        b, t = mbs[0].tokens.shape
        # seq_length: the whole row (megatron divides it by CP, and by TP with SP, for the stages' shapes)
        with replay if replay is not None else nullcontext():
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=self.model,
                num_microbatches=len(mbs), seq_length=t * self.cp_size, micro_batch_size=b, forward_only=forward_only)
        self.last_replay, self.last_micro_batches = replay, mbs
        return out

    @torch.no_grad()
    def routed_experts(self, seqs: list[torch.Tensor], routes: list[torch.Tensor] | None = None
                       ) -> list[torch.Tensor]:
        """The experts the routers used for every token of each sequence ([len, layers, k], sorted),
        routing freely or replaying `routes` (checks; TP = PP = CP = 1)."""
        assert self.tp_size == self.pp_size == self.cp_size == 1, "routed_experts reads one rank's whole model"
        self.routes, self.record_routing = routes, True
        try:
            self.compute_logprob(seqs)
        finally:
            self.routes, self.record_routing = None, False
        out: dict[int, torch.Tensor] = {}
        lengths = [int(s.numel()) for s in seqs]
        for used, mb in zip(self.last_replay.recorded, self.last_micro_batches, strict=True):
            b, t = mb.tokens.shape
            places = torch.stack(used, dim=1).view(t, b, len(used), -1).transpose(0, 1)
            out.update(unlayout_routes(places, mb, lengths))
        return [out[i] for i in range(len(seqs))]

    def _replay_routing(self) -> ReplayRouting | None:
        """The routers' replay of `self.routes` (per-sequence recorded experts), when set."""
        if getattr(self, "routes", None) is None and not getattr(self, "record_routing", False):
            return None
        if not self.model.config.moe_enable_routing_replay:
            raise RuntimeError("routes given to an engine built without routing replay (EngineOptions.moe)")
        from megatron.core import parallel_state as ps

        from hpcrl.engines.megatron.convert import layer_range

        return ReplayRouting(routers(self.model), layer_range(self.arch, ps.get_pipeline_model_parallel_rank(),
                                                              self.pp_size).start)

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
            if select is not None and not self._selects_positions:  # every position computed: 0 elsewhere
                v = v * select(mb).to(v.device)
            return v.sum() * 0.0, torch.tensor(1), {"values": v.detach().cpu(), "mb": mb}

        fields = {"positions": [p.float() for p in positions]} if positions is not None else None
        select = (lambda mb: mb.extra["positions"].bool() & mb.label_mask.bool()) if positions is not None else None
        store = self._run(self._micro_batches(seqs, fields), loss_fn, forward_only=True, positions=select)
        if not store:
            return None
        out: dict[int, torch.Tensor] = {}
        for item in store:
            values, mb = item["values"], item["mb"]
            if self.cp_size > 1:  # every CP rank's part, in the row's order (a CP collective)
                from megatron.core import parallel_state as ps

                values, mb = gather_row_values(values, mb, ps.get_context_parallel_group()), mb.full
            out.update(unpack_token_values(values, mb))
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

    @torch.no_grad()
    def compute_entropy(self, seqs: list[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor] | None:
        """Per-position entropy of softmax(logits / temperature) (entry t: of the distribution of
        seq[t+1]); last pipeline stage only."""
        return self._forward_collect(seqs, lambda output, mb: self._spread(self.token_entropy(output, temperature), mb))

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
