"""The FSDP engine's forwards and update: packed micro-batches, log-probs, entropies, values, and one
optimizer step over a mini-batch.

Micro-batches are laid out as the Megatron engine lays them out (hpcrl.engines.megatron.packing): with
`packing` one row of whole sequences back to back under `micro_batch_tokens`, the samples of one prompt
sharing it (`share_prompt`); without, `micro_batch_size` sequences per row, right-padded. Each sequence
attends only to itself, at its own positions (`position_ids` drive RoPE), in one of two ways:
- a block-diagonal causal mask, the [B, 1, T, T] mask `pack` builds (attention "sdpa" or "eager", the CPU
  path): the only way a shared prompt's branches see their prefix. Not for a sequence longer than a
  sliding window (the mask replaces the model's own, so the window would be lost): those micro-batches
  go the second way;
- `position_ids` alone (flash attention on GPU, and the case above): transformers cuts the row where the
  positions restart, varlen attention under flash attention and its own per-sequence mask otherwise
  (window included; transformers looks for packed rows only without a KV cache: the engine sets
  use_cache off). No prompt sharing there. Which attention the model has: attention.py.

Every FSDP forward all-gathers each layer's parameters over the group, so every rank must run the same
number of forwards (and backwards): a rank with fewer micro-batches than the most loaded one runs empty
ones (no output position; zero gradients). Results and loss fields are laid out like labels: position t
of a row holds the prediction of labels[t], `label_mask` 1 on the real positions.

`ForwardMixin` is part of `FsdpEngine` (hpcrl.engines.fsdp.engine), which sets `model`, `options`,
`group`, `device`, `units`, `value_head`, `optimizer`, `optim`, `trainable`, `step_count`, `nonfinite_in_a_row`,
`record_grads`, `masked_attention`, `sliding_window`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.engines.fsdp.shards import gather_full, local_shard
from hpcrl.engines.megatron.optimizer import lr_factor, square_sum
from hpcrl.engines.megatron.packing import (
    PackedMicroBatch,
    pack,
    packing_units,
    plan_micro_batches,
    plan_padded_micro_batches,
    unit_length,
    unpack_token_values,
)

log = logging.getLogger("hpcrl.engine")


class ForwardMixin:
    """The forward and update part of `FsdpEngine`."""

    def _micro_batches(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None = None
                       ) -> list[PackedMicroBatch]:
        """The call's micro-batches (see the module docstring), each only as long as its longest row."""
        lengths = [int(s.numel()) for s in seqs]
        window = self.sliding_window
        masked = self.masked_attention and (window is None or max(lengths, default=0) <= window)
        if self.options.packing:
            units = packing_units(seqs, token_fields, self.options.micro_batch_tokens,
                                  self.options.share_prompt and masked)
            groups = plan_micro_batches([unit_length(u, lengths) for u in units], self.options.micro_batch_tokens)
            rows_of = [[[units[u] for u in g]] for g in groups]
        else:
            rows_of = [[[i] for i in g] for g in plan_padded_micro_batches(len(seqs), self.options.micro_batch_size)]
        return [pack(seqs, rows, max(sum(unit_length(u, lengths) for u in row) for row in rows), token_fields,
                     dense_mask=masked) for rows in rows_of]

    def _equalised(self, mbs: list[PackedMicroBatch], fields: list[str]) -> list[PackedMicroBatch]:
        """`mbs` plus empty micro-batches up to the group's most (every rank runs as many forwards)."""
        n = torch.tensor([len(mbs)], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        zeros = torch.zeros(1, 2)
        empty = PackedMicroBatch(torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None], None,
                                 torch.zeros(1, 2, dtype=torch.long), zeros, [], {k: zeros for k in fields})
        return mbs + [empty] * (int(n) - len(mbs))

    def _output(self, mb: PackedMicroBatch, select: torch.Tensor) -> torch.Tensor:
        """The model's output (logits [n, V] or values [n]) at the selected label positions."""
        mask = None
        if mb.attention_mask is not None:  # pack's mask is True where masked out; transformers' the reverse
            keep = ~mb.attention_mask.to(self.device)
            mask = keep if self.model.hf.config._attn_implementation == "sdpa" else \
                torch.zeros(keep.shape, dtype=self.options.dtype, device=self.device).masked_fill(
                    ~keep, torch.finfo(self.options.dtype).min)
        return self.model(mb.tokens.to(self.device), select.to(self.device), mb.position_ids.to(self.device), mask)

    @staticmethod
    def _scatter(values: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """Values at the selected positions back to select's shape, zeros elsewhere (differentiable)."""
        select = select.to(values.device)
        return torch.zeros(select.shape, dtype=values.dtype, device=values.device).masked_scatter(select, values)

    @staticmethod
    def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(label) under softmax(logits / temperature), in fp32."""
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return lp.gather(-1, labels[..., None].to(lp.device))[..., 0]

    @staticmethod
    def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of softmax(logits / temperature) per position, in fp32."""
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return -(lp.exp() * lp).sum(-1)

    @torch.no_grad()
    def _forward_collect(self, seqs: list[torch.Tensor],
                         per_position: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         positions: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Forward only; per_position(output, labels at the selected positions) -> values there, cut back
        into one [len-1] tensor per sequence (zeros outside `positions` when given)."""
        self.model.eval()
        fields = {"positions": [p.float() for p in positions]} if positions is not None else None
        out: dict[int, torch.Tensor] = {}
        for mb in self._equalised(self._micro_batches(seqs, fields), ["positions"] if fields else []):
            select = mb.label_mask.bool()
            if fields is not None:
                select &= mb.extra["positions"].bool()
            values = self._scatter(per_position(self._output(mb, select), mb.labels[select]), select).cpu()
            out.update({i: v.clone() for i, v in unpack_token_values(values, mb).items()})
        if not self.options.reshard_after_forward:
            # FSDP2 reshards such units in the backward only: without one they would stay gathered
            for unit in self.units:
                unit.reshard()
        return [out[i] for i in range(len(seqs))]

    def compute_logprob(self, seqs: list[torch.Tensor], temperature: float = 1.0,
                        positions: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Per-token log-probs of each sequence (entry t: log p(seq[t+1] | seq[:t+1])) under
        softmax(logits / temperature); with positions (label-aligned bool), only there (0 elsewhere)."""
        return self._forward_collect(seqs, lambda logits, labels: self.token_logprobs(logits, labels, temperature),
                                     positions)

    def compute_entropy(self, seqs: list[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-position entropy of softmax(logits / temperature)."""
        return self._forward_collect(seqs, lambda logits, labels: self.token_entropy(logits, temperature))

    def compute_values(self, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-position values (entry t: the state seq[:t+1]) from the value head."""
        assert self.value_head, "compute_values needs an engine built with value_head=True"
        return self._forward_collect(seqs, lambda values, labels: values.float())

    # the update --------------------------------------------------------------------------------
    def train_step(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]],
                   loss_fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
                   need_entropy: bool = False, temperature: float = 1.0, entropy_grad: bool = True
                   ) -> dict[str, float]:
        """One optimizer step over this rank's part of a mini-batch: the Megatron engine's contract.
        loss_fn(output, entropy, fields) gets per-position log-probs (actor) or values (critic) laid
        out like labels and returns (weighted loss sum, metric sums); gradients are summed over DP."""
        assert self.optimizer is not None and self.optim is not None, "engine built without an optimizer"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        store: list[dict[str, torch.Tensor]] = []
        names = list(token_fields)
        mbs = self._equalised(self._micro_batches(seqs, token_fields), names)
        accumulate = self.options.accumulate_unsharded and len(mbs) > 1
        try:
            for i, mb in enumerate(mbs):
                if accumulate:
                    self._accumulating(i < len(mbs) - 1)
                self._micro_step(mb, loss_fn, need_entropy, temperature, entropy_grad, store)
        finally:
            if accumulate:
                self._accumulating(False)
        if self.record_grads is not None:
            self.record_grads.append({n: _full_grad(p) for n, p in self.named_trainable()})
        grad_norm = self._clip_grads(self.optim.clip_grad)
        finite = self._apply_update(grad_norm)
        return {**self._sum_metrics(store), "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                "nonfinite_skipped": float(not finite), "nonfinite_in_a_row": float(self.nonfinite_in_a_row)}

    def _accumulating(self, on: bool) -> None:
        """Inside a step's micro-batches (on): every unit stays gathered and keeps its unsharded
        gradient (no reduce-scatter); off: FSDP's per-unit gathering and reduce-scatter (the last
        micro-batch's backward reduce-scatters what was accumulated)."""
        for unit in self.units:
            unit.set_requires_gradient_sync(not on, recurse=False)
            unit.set_reshard_after_backward(not on, recurse=False)
            unit.set_reshard_after_forward(False if on else self.options.reshard_after_forward, recurse=False)

    def _micro_step(self, mb: PackedMicroBatch, loss_fn: Callable[..., Any], need_entropy: bool, temperature: float,
                    entropy_grad: bool, store: list[dict[str, torch.Tensor]]) -> None:
        """One micro-batch's forward and backward; its metrics appended to `store`."""
        select = mb.label_mask.bool()
        if not self.value_head and "loss_weight" in mb.extra:  # the actor's logits where a loss weight is
            select &= mb.extra["loss_weight"] > 0
        output = self._output(mb, select)
        if not mb.placement:  # the group's forwards and gradient reductions, with nothing of this rank's
            (output.sum() * 0.0).backward()
            return
        entropy = None
        if self.value_head:
            out = self._scatter(output.float(), select)
        else:
            out = self._scatter(self.token_logprobs(output, mb.labels[select], temperature), select)
            if need_entropy:
                with torch.set_grad_enabled(entropy_grad):
                    entropy = self._scatter(self.token_entropy(output if entropy_grad else output.detach(),
                                                               temperature), select)
        fields = {k: v.to(out.device) for k, v in mb.extra.items()}
        fields["label_mask"] = mb.label_mask.to(out.device)
        loss, metrics = loss_fn(out, entropy, fields)
        loss.backward()
        store.append({k: v.detach().float().cpu() for k, v in {"loss": loss, **metrics}.items()})

    def _clip_grads(self, max_norm: float) -> float:
        """Global L2 norm of the gradient (each rank's shards' squares summed over the group); scaled
        down to max_norm when above it."""
        local = torch.zeros(1, dtype=torch.float64)
        grads = [local_shard(p.grad) for p in self.trainable if p.grad is not None]
        for g in grads:
            local += square_sum(g).cpu()
        dist.all_reduce(local, group=self.group)
        norm = float(local.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        return norm

    def _apply_update(self, grad_norm: float) -> bool:
        """Step AdamW with the clipped gradients unless the norm is not finite (the same on every rank);
        then drop the gradients."""
        finite = math.isfinite(grad_norm)
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = self.optim.lr * lr_factor(self.step_count, self.optim)
            self.optimizer.step()
            self.step_count += 1
        else:
            log.warning("rank %d: optimizer step %d skipped, gradient norm %s (%d in a row)", dist.get_rank(),
                        self.step_count + 1, grad_norm, self.nonfinite_in_a_row)
        self.optimizer.zero_grad(set_to_none=True)
        return finite

    def _sum_metrics(self, store: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Metric sums over micro-batches and DP ranks; metrics named *_max are maxima instead."""
        keys_per_rank: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(keys_per_rank, sorted(store[0]) if store else [], group=self.group)
        keys = sorted({k for ks in keys_per_rank for k in ks})
        is_max = torch.tensor([k.endswith("_max") for k in keys], dtype=torch.bool)
        vec = torch.zeros(len(keys), dtype=torch.float64)
        for item in store:
            vals = torch.tensor([float(item.get(k, 0.0)) for k in keys], dtype=torch.float64)
            vec = torch.where(is_max, torch.maximum(vec, vals), vec + vals)
        sums, maxes = vec.clone(), vec.clone()
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.group)
        return dict(zip(keys, torch.where(is_max, maxes, sums).tolist(), strict=True))


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's full gradient in fp32 (a collective over the shards' group); zeros when it has none."""
    g = p.grad
    if g is None:
        g = torch.zeros_like(p)
    return gather_full(g, torch.float32).cpu().clone()
