"""The engine's optimizer: settings and LR schedule, AdamW over what this rank steps (its DP share with
ZeRO-1), fp32 masters and gradient buffers for low-precision weights, the DP reduction of gradients,
the global gradient norm and its clip, and the step that skips a non-finite gradient.

`OptimizerMixin` is part of `MegatronEngine` (hpcrl.engines.megatron.engine), which sets the
attributes it reads: `model`, `trainable`, `optim`, `master`, `shards`, `step_count`, `dp_size`,
`tp_size`, `pp_size`, `arch`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from hpcrl.engines.megatron.optim_shards import OptimizerShards

log = logging.getLogger("hpcrl.engine")


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


class OptimizerMixin:
    """The optimizer's part of `MegatronEngine`."""

    def _build_optimizer(self, optim: OptimSettings) -> None:
        """AdamW over what this rank steps (its DP share with ZeRO-1), with fp32 masters and
        fp32 gradient buffers for low-precision weights."""
        from megatron.core import parallel_state as ps

        # (fewer tensors than DP ranks would leave a rank with nothing to step: not cut then)
        # over the DP x CP replicas (as megatron's distributed optimizer): CP ranks hold the same
        # weights and gradients, so CP cuts the state per rank as DP does
        # (not with expert parallel: the EP ranks of one DP x CP group step different experts)
        expert_parallel = self.arch.is_moe and ps.get_expert_model_parallel_world_size() > 1
        if optim.shard_over_dp and 1 < self.replicas <= len(self.trainable) and not expert_parallel:
            self.shards = OptimizerShards([p.numel() for p in self.trainable],
                                          ps.get_data_parallel_group(with_context_parallel=True))
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
        """With the state sharded over DP (x CP; collective over that group): on replica 0, the optimizer
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

    def _apply_update(self, grad_norm: float) -> bool:
        """Step the optimizer with the clipped gradients unless `grad_norm` is not finite; then drop
        the gradients. True when the step was taken."""
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
        return finite

    def _finish_grads(self) -> None:
        """Sum gradients over DP (and CP; SP norms over TP), and tie the embedding's two copies when PP splits them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        params = self.trainable
        for p in params:
            if self._grad(p) is None:
                p.grad = torch.zeros_like(p)
        if self.tp_size > 1:
            # a norm weight under SP saw only this rank's slice of the sequence, a q/k norm only this
            # rank's heads (and an MoE router under SP its slice of the tokens): sum the TP partials
            tp_group = ps.get_tensor_model_parallel_group()
            for work in [dist.all_reduce(self._grad(p), group=tp_group, async_op=True) for p in params
                         if getattr(p, "sequence_parallel", False)]:
                work.wait()
        if self.replicas > 1:
            # Each gradient in place, all queued at once: no flat copy. A fresh flat buffer of the
            # model's size is a model's worth of page faults per step on CPU: flattening the demo
            # model's 540 MB of gradients took 1.5 s of its 2 workers' optimizer steps (py-spy).
            # Summed over DP and CP: a CP rank's loss is its tokens' share of the mini-batch's.
            group = ps.get_data_parallel_group(with_context_parallel=True)
            # an MoE layer's experts (megatron marks them allreduce=False) are copies on the expert-DP
            # ranks only: DP x CP / EP of them, each EP rank holding other experts
            expert_group = ps.get_expert_data_parallel_group() if self.arch.is_moe else None
            for work in [dist.all_reduce(self._grad(p), group=group if getattr(p, "allreduce", True)
                                         else expert_group, async_op=True) for p in params]:
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
        experts = torch.zeros(1, dtype=torch.float64)  # TP shards of this EP rank's experts
        tied_copy = (self.model.output_layer.weight if self.arch.tie_word_embeddings and self.pp_size > 1
                     and not self.model.pre_process and self.model.post_process else None)
        for p in self.trainable:
            if self._grad(p) is None or p is tied_copy:
                continue
            sq = square_sum(self._grad(p))
            if not getattr(p, "allreduce", True):
                experts += sq
            elif getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        if self.arch.is_moe:
            # expert tensor parallel = TP; the EP ranks hold different experts
            if self.tp_size > 1:
                dist.all_reduce(experts, group=ps.get_expert_tensor_parallel_group())
            if ps.get_expert_model_parallel_world_size() > 1:
                dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
        total = sharded + replicated + experts
        if self.pp_size > 1:
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        norm = float(total.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.trainable:
                if self._grad(p) is not None:
                    self._grad(p).mul_(scale)
        return norm
