"""The engine's update: one optimizer step over this rank's part of a mini-batch (loss over packed
micro-batches, gradients reduced and clipped, the step taken or skipped), with the metrics summed over
micro-batches, DP (and CP) ranks and pipeline stages.

`TrainStepMixin` is part of `MegatronEngine` (hpcrl.engines.megatron.engine); it calls the forward
(`ForwardMixin`) and optimizer (`OptimizerMixin`) parts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from hpcrl.engines.megatron.moe import RoutingStats
from hpcrl.engines.megatron.packing import PackedMicroBatch


class TrainStepMixin:
    """The update's part of `MegatronEngine`."""

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
        with RoutingStats(self.model, self.arch) if self.arch.is_moe else nullcontext() as routing:
            store = self._run(mbs, micro_loss, forward_only=False, positions=select)
        self._positions = None
        self._finish_grads()
        if self.record_grads is not None:
            self.record_grads.append({n: self._grad(p).detach().float().clone()
                                      for n, p in self.named_trainable()})
        grad_norm = self._clip_grads(self.optim.clip_grad)
        finite = self._apply_update(grad_norm)
        return {**self._sum_metrics(store), **self._routing_metrics(routing), "grad_norm": grad_norm,
                "lr": self.optimizer.param_groups[0]["lr"],
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
        # DP x CP: a CP rank's sums are its tokens' share
        replicas = ps.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(sums, group=replicas)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=replicas)
        return dict(zip(keys, torch.where(is_max, maxes, sums).tolist(), strict=True))

    def _routing_metrics(self, routing: RoutingStats | None) -> dict[str, float]:
        """An MoE model's routing in this update (hpcrl.engines.megatron.moe), averaged over its MoE
        layers: tokens per expert (max / mean), load-balancing loss, router entropy."""
        if routing is None:
            return {}
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        # the ranks that routed different tokens: DP x CP, and TP under SP (each its slice)
        groups = [ps.get_data_parallel_group(with_context_parallel=True)]
        if self.tp_size > 1 and self.model.config.sequence_parallel:
            groups.append(ps.get_tensor_model_parallel_group())
        routing.reduce(groups)
        local = routing.metrics()
        keys = ["moe/layers", "moe/tokens_per_expert_max_over_mean", "moe/load_balancing_loss", "moe/router_entropy"]
        vec = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64)
        if self.pp_size > 1:  # each stage its layers' sums
            dist.all_reduce(vec, group=ps.get_pipeline_model_parallel_group())
        layers = float(vec[0])
        out = {k: float(v) / layers for k, v in zip(keys[1:], vec[1:], strict=True)} if layers else {}
        replay = getattr(self, "last_replay", None)
        if replay is not None and replay.places:
            # routing replay: the share of routed places (token x MoE layer) that took the rollout's experts
            # (the rest: each sequence's last token, which vLLM never routes, and row padding)
            counts = torch.tensor([replay.replayed, replay.places], dtype=torch.float64)
            for g in groups:
                dist.all_reduce(counts, group=g)
            if self.pp_size > 1:
                dist.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
            out["moe/replayed_share"] = float(counts[0] / counts[1])
        return out
