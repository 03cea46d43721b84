"""The FSDP engine's forwards and update: padded micro-batches, log-probs, entropies, values, and one
optimizer step over a mini-batch.

Every FSDP forward all-gathers each layer's parameters over the group, so every rank must run the same
number of forwards (and backwards): a rank with fewer micro-batches than the most loaded one runs empty
ones (no output position; zero gradients). Results and loss fields are laid out like labels: row i of a
micro-batch is one sequence, entry t the prediction of token t+1, `label_mask` 1 on the real positions.

`ForwardMixin` is part of `FsdpEngine` (hpcrl.engines.fsdp.engine), which sets `model`, `options`,
`group`, `device`, `units`, `value_head`, `optimizer`, `optim`, `trainable`, `step_count`, `nonfinite_in_a_row`,
`record_grads`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.engines.fsdp.shards import gather_full, local_shard
from hpcrl.engines.megatron.optimizer import lr_factor, square_sum

log = logging.getLogger("hpcrl.engine")


@dataclass
class PaddedMicroBatch:
    """Whole sequences, right-padded to the longest: `ids` [B, T], per-position `label_mask` and token
    fields [B, T-1]. `placement[i].seq` is row i's index in the call's sequence list."""

    ids: torch.Tensor
    label_mask: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    placement: list[Any] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.placement


class ForwardMixin:
    """The forward and update part of `FsdpEngine`."""

    def _micro_batches(self, seqs: list[torch.Tensor], token_fields: dict[str, list[torch.Tensor]] | None = None
                       ) -> list[PaddedMicroBatch]:
        """Consecutive sequences per micro-batch while rows x longest row stays within
        options.micro_batch_tokens (a longer sequence is a micro-batch of its own)."""
        budget = self.options.micro_batch_tokens
        groups: list[list[int]] = []
        for i, s in enumerate(seqs):
            if groups and (len(groups[-1]) + 1) * max(s.numel(), *(seqs[j].numel() for j in groups[-1])) <= budget:
                groups[-1].append(i)
            else:
                groups.append([i])
        return [self._pad(seqs, rows, token_fields or {}) for rows in groups]

    @staticmethod
    def _pad(seqs: list[torch.Tensor], rows: list[int], fields: dict[str, list[torch.Tensor]]) -> PaddedMicroBatch:
        width = max(seqs[i].numel() for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width - 1)
        extra = {k: torch.zeros(len(rows), width - 1, dtype=v[0].dtype if v else torch.float32)
                 for k, v in fields.items()}
        for r, i in enumerate(rows):
            n = seqs[i].numel()
            ids[r, :n] = seqs[i]
            mask[r, :n - 1] = 1
            for k, v in fields.items():
                extra[k][r, :n - 1] = v[i]
        return PaddedMicroBatch(ids, mask, extra, [SimpleNamespace(seq=i) for i in rows])

    def _equalised(self, mbs: list[PaddedMicroBatch], fields: list[str]) -> list[PaddedMicroBatch]:
        """`mbs` plus empty micro-batches up to the group's most (every rank runs as many forwards)."""
        n = torch.tensor([len(mbs)], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        empty = PaddedMicroBatch(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1),
                                 {k: torch.zeros(1, 1) for k in fields})
        return mbs + [empty] * (int(n) - len(mbs))

    def _output(self, mb: PaddedMicroBatch, select: torch.Tensor) -> torch.Tensor:
        """The model's output (logits [n, V] or values [n]) at the selected label positions."""
        return self.model(mb.ids.to(self.device), select.to(self.device))

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
            values = self._scatter(per_position(self._output(mb, select), mb.ids[:, 1:][select]), select).cpu()
            for r, p in enumerate(mb.placement):
                out[p.seq] = values[r, :seqs[p.seq].numel() - 1].clone()
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

    def _micro_step(self, mb: PaddedMicroBatch, loss_fn: Callable[..., Any], need_entropy: bool, temperature: float,
                    entropy_grad: bool, store: list[dict[str, torch.Tensor]]) -> None:
        """One micro-batch's forward and backward; its metrics appended to `store`."""
        select = mb.label_mask.bool()
        if not self.value_head and "loss_weight" in mb.extra:  # the actor's logits where a loss weight is
            select &= mb.extra["loss_weight"] > 0
        output = self._output(mb, select)
        if mb.empty:  # the group's forwards and gradient reductions, with nothing of this rank's
            (output.sum() * 0.0).backward()
            return
        entropy = None
        if self.value_head:
            out = self._scatter(output.float(), select)
        else:
            out = self._scatter(self.token_logprobs(output, mb.ids[:, 1:][select], temperature), select)
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
