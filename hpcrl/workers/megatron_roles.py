"""Model roles as worker-group objects: actor, reference and critic, on the Megatron-core engine or
the FSDP engine (`actor.engine`, docs/fsdp.md).

The controller writes `lp = actor.compute_logprob(batch)`: the batch is cut into DP shards, every
TP/PP rank of a shard runs the method, and the output of TP rank 0 on the last pipeline stage of
each shard comes back, concatenated in DP order (see hpcrl.controller.dispatch).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hpcrl.algos.losses import kl_estimate, ppo_policy_loss, value_loss
from hpcrl.config.derived import kl_loss_active, role_engine
from hpcrl.controller import Collect, Dispatch, Worker, register
from hpcrl.controller.batch import Batch
from hpcrl.engines.megatron.lora import adapters_to_hf
from hpcrl.workers.batching import sequences, to_label_aligned, to_token_aligned
from hpcrl.workers.memory import peak_memory
from hpcrl.workers.role_engines import build_engine

FIRST_STEP_ONLY = "logprob_gap_"  # metrics of an update's first optimizer step (before any change)


def _gloo_threads() -> int:
    """Threads of this process that gloo runs for its process groups (by thread name)."""
    import os

    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().startswith(("pt_gloo", "gloo"))
        except OSError:  # the thread ended meanwhile
            pass
    return n


class MegatronRole(Worker):
    """One rank of a model role: `role` is actor, reference or critic; `cfg` the resolved config (a plain
    dict, as it travels from the controller). The role's `engine` key picks the Megatron engine or the
    FSDP engine (hpcrl.engines.fsdp); the methods below are the same for both."""

    def __init__(self, cfg: dict[str, Any], role: str = "actor", model_path: str | None = None,
                 ranks: list[int] | None = None):
        self.role = role
        self.cfg = cfg
        section = cfg[role]
        path = model_path or (cfg["critic"].get("model_path") if role == "critic" else None) or cfg["model"]["path"]
        self.model_path = path
        self.section = section
        self.policy_loss = cfg["algorithm"]["policy_loss"]
        # The actor's and the reference's log-probs are those of the distribution the rollout
        # samples from, softmax(logits / T): ratios, KL and entropy then belong to that policy.
        self.temperature = float(cfg["rollout"]["temperature"]) if role in ("actor", "reference") else 1.0
        self.engine_kind = role_engine(cfg, role)
        self.engine = build_engine(cfg, role, path, ranks)

    def parallel_coords(self) -> tuple[int, int, int]:
        """(dp, model-parallel, pp): the TP x CP ranks of a stage share their DP rank's data, and
        CP rank 0's TP rank 0 hands out the results (hpcrl.controller.dispatch.ParallelLayout)."""
        e = self.engine
        return (e.dp_rank, e.tp_rank + e.tp_size * e.cp_rank, e.pp_rank)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def describe(self) -> dict[str, Any]:
        """What this role runs on: layer spec (local or Transformer Engine), device, dtype, backend."""
        import os

        import torch._dynamo
        import torch.distributed as dist

        e = self.engine
        return {"spec": e.spec, "device": str(next(e.model.parameters()).device), "dtype": str(e.options.dtype),
                "backend": dist.get_backend(), "tp": e.tp_size, "pp": e.pp_size, "dp": e.dp_size, "cp": e.cp_size,
                "ep": e.ep_size, "experts": e.arch.num_experts,
                "sequence_parallel": bool(getattr(getattr(e.model, "config", None), "sequence_parallel", False)),
                "recompute": e.options.recompute, "engine": self.engine_kind,
                # the FSDP engine's attention implementation, and whether it takes the block-diagonal mask
                "attention": getattr(getattr(getattr(e.model, "hf", None), "config", None), "_attn_implementation",
                                     None), "masked_attention": getattr(e, "masked_attention", None),
                # vLLM's CPU worker turns torch.set_num_threads into a no-op once it is built, so this
                # stays what OMP_NUM_THREADS gave (hpcrl run: 1 per rank, every rank its own process)
                "torch_threads": torch.get_num_threads(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
                "torch_compile": not torch._dynamo.config.disable,  # off on CPU: hpcrl.engines.no_compile_on_cpu
                # every group alive in this process (torch's registry): a layout's, not every layout's so far
                "process_groups": len(dist.distributed_c10d._world.pg_map),
                # threads of live gloo groups (a few each): a group dropped from the registry but
                # still referenced keeps them, and they wake every 10 ms
                "gloo_threads": _gloo_threads()}

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def peak_memory(self, reset: bool = True) -> dict[str, float]:
        """This worker process's peak memory (GB) since the last call: hpcrl.workers.memory."""
        return peak_memory(reset)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state and fp32 masters this rank keeps (its DP share when
        optim.shard_over_dp cuts them over DP)."""
        return self.engine.optimizer_state_bytes()

    def set_temperature(self, temperature: float) -> None:
        """The T of the log-probs' softmax(logits / T) (set from rollout.temperature; tests)."""
        self.temperature = float(temperature)

    def set_packing(self, packing: bool, micro_batch_size: int = 4, share_prompt: bool | None = None) -> None:
        """Switch between packed micro-batches and the padded baseline, and prompt sharing on or
        off (benchmarks, tests)."""
        self.engine.options.packing = packing
        self.engine.options.micro_batch_size = micro_batch_size
        if share_prompt is not None:
            self.engine.options.share_prompt = share_prompt

    # forward -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _adapters(self, on: bool) -> Iterator[None]:
        """The model with its LoRA adapters (on), or its frozen base alone (the reference policy)."""
        lora = self.engine.lora
        if on or lora is None:
            yield
        else:
            with lora.adapters_off():
                yield

    def _routes(self, batch: Batch, seqs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per sequence, the experts the rollout routed each token to (routing replay), or None."""
        moe = getattr(self.engine.options, "moe", None)  # (the FSDP engine has no routing replay)
        if moe is None or not moe.routing_replay or "routed_experts" not in batch.keys():
            return None
        routes = batch["routed_experts"]
        return [routes[i, :s.numel()] for i, s in enumerate(seqs)]

    @contextlib.contextmanager
    def _replaying(self, routes: list[torch.Tensor] | None) -> Iterator[None]:
        """The engine's forwards inside replay `routes` (None: route freely)."""
        self.engine.routes = routes
        try:
            yield
        finally:
            self.engine.routes = None

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def compute_logprob(self, batch: Batch, response_only: bool = False, adapters: bool = True
                        ) -> torch.Tensor | None:
        """Token-aligned log-probs [B, S] of the batch's tokens under this model; response_only:
        of the response tokens alone (0 elsewhere; the losses need no more). adapters=False: under
        the frozen base of a LoRA actor (its reference policy)."""
        seqs = sequences(batch)
        positions = ([m > 0 for m in to_label_aligned(batch, "response_mask", seqs)] if response_only else None)
        with self._adapters(adapters), self._replaying(self._routes(batch, seqs)):
            lp = self.engine.compute_logprob(seqs, self.temperature, positions)
        if lp is None or not self.engine.is_output_rank:
            return None
        return to_token_aligned(lp, tuple(batch["input_ids"].shape))

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def routed_experts(self, batch: Batch, replay: bool = True) -> torch.Tensor:
        """The experts this MoE actor's routers use for every token [B, S, layers, k] (sorted; -1 past
        each sequence), replaying the batch's `routed_experts` or (replay=False) routing freely. Checks;
        TP = PP = CP = 1."""
        seqs = sequences(batch)
        used = self.engine.routed_experts(seqs, self._routes(batch, seqs) if replay else None)
        out = torch.full((len(seqs), batch["input_ids"].shape[1], *used[0].shape[1:]), -1, dtype=torch.int16)
        for i, u in enumerate(used):
            out[i, :u.shape[0]] = u
        return out

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def compute_entropy(self, batch: Batch) -> torch.Tensor | None:
        """Token-aligned entropies [B, S] of the policy at the rollout temperature: entry t is the
        entropy of the distribution token t was drawn from."""
        ent = self.engine.compute_entropy(sequences(batch), self.temperature)
        if ent is None or not self.engine.is_output_rank:
            return None
        return to_token_aligned(ent, tuple(batch["input_ids"].shape))

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def compute_values(self, batch: Batch) -> torch.Tensor | None:
        """Token-aligned values [B, S] (critic): entry t values the state just before token t."""
        seqs = sequences(batch)
        vals = self.engine.compute_values(seqs)
        if vals is None or not self.engine.is_output_rank:
            return None
        return to_token_aligned(vals, tuple(batch["input_ids"].shape))

    # updates -----------------------------------------------------------------------------------
    def _minibatch_steps(self, batch: Batch, num_minibatches: int, epochs: int, fields: list[str],
                         loss_fn: Any, need_entropy: bool = False, after_step: list[int] | None = None,
                         entropy_grad: bool = True) -> dict[str, float]:
        """Optimizer steps over this rank's shard, arranged by `arrange_minibatches`. Metrics named
        FIRST_STEP_ONLY* come from the first step alone (after_step[0] counts the steps taken)."""
        seqs_all = sequences(batch)
        label_fields = {k: to_label_aligned(batch, k, seqs_all) for k in [*fields, "loss_weight"]}
        routes_all = self._routes(batch, seqs_all)
        chunks = torch.arange(len(batch)).chunk(num_minibatches)
        history: list[dict[str, float]] = []
        for _ in range(epochs):
            for idx in chunks:
                rows = idx.tolist()
                with self._replaying(None if routes_all is None else [routes_all[i] for i in rows]):
                    history.append(self.engine.train_step(
                        [seqs_all[i] for i in rows], {k: [v[i] for i in rows] for k, v in label_fields.items()},
                        loss_fn, need_entropy=need_entropy, temperature=self.temperature, entropy_grad=entropy_grad))
                if after_step is not None:
                    after_step[0] += 1
        first = {k: history[0].pop(k) for k in list(history[0]) if k.startswith(FIRST_STEP_ONLY)}
        skipped = sum(h.pop("nonfinite_skipped") for h in history)
        in_a_row = [h.pop("nonfinite_in_a_row") for h in history][-1]
        out = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
        out.update(first)
        out["optimizer_steps"] = float(len(history))
        # steps skipped for a non-finite loss or gradient (the engine left the weights as they were),
        # and how many in a row up to now: the trainer stops at trainer.max_nonfinite_steps
        out["nonfinite_steps_skipped"] = skipped
        out["nonfinite_steps_in_a_row"] = in_a_row
        return out

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0)
    def update_actor(self, batch: Batch, num_minibatches: int = 1, epochs: int = 1) -> dict[str, float]:
        """PPO-family policy update. Fields: advantages, loss_weight (from arrange_minibatches),
        old_logprob, optional ref_logprob for the KL loss, optional is_weight (a per-token weight of
        the policy loss: the behaviour weight of algorithm.rollout_correction=tis|mis).
        Returns mini-batch means.

        Without old_logprob the update is on-policy (one mini-batch, one epoch: the caller checks):
        the old log-probs are this forward's own, detached (ratio 1, the gradient of a separate
        old-log-prob pass). With rollout_logprob, the first optimizer step also measures the
        rollout-vs-actor gap on the response tokens (logprob_gap_sum / _tokens / _max)."""
        s = self.section
        use_kl = kl_loss_active(self.cfg)
        on_policy = "old_logprob" not in batch.keys()
        measure_gap = "rollout_logprob" in batch.keys()
        weighted = "is_weight" in batch.keys()
        fields = (["advantages"] + ([] if on_policy else ["old_logprob"]) + (["ref_logprob"] if use_kl else [])
                  + (["rollout_logprob"] if measure_gap else []) + (["is_weight"] if weighted else []))
        dual_c = s["clip_ratio_c"] if self.policy_loss == "dual_clip" else None
        entropy_coeff = float(s["entropy_coeff"])
        steps_done = [0]  # optimizer steps taken in this call (the gap is measured before the first)

        def loss_fn(lp: torch.Tensor, ent: torch.Tensor | None, f: dict[str, torch.Tensor]):
            w = f["loss_weight"] * f["label_mask"]
            old = lp.detach() if on_policy else f["old_logprob"]
            pg, clipped = ppo_policy_loss(lp, old, f["advantages"], s["clip_ratio_low"], s["clip_ratio_high"], dual_c)
            if weighted:
                pg = pg * f["is_weight"]
            loss = (w * pg).sum()
            metrics = {"pg_loss": (w * pg).sum(), "pg_clipfrac": (w * clipped.float()).sum(),
                       "ppo_kl": (w * (old - lp)).sum()}
            if dual_c is not None:  # the share of tokens the dual clip caps (A < 0 and ratio > c)
                capped = (f["advantages"] < 0) & (torch.exp(lp.detach() - old) > dual_c)
                metrics["pg_clipfrac_dual"] = (w * capped.float()).sum()
            if measure_gap and steps_done[0] == 0:
                resp = (f["loss_weight"] > 0) & f["label_mask"].bool()
                d = (lp.detach() - f["rollout_logprob"]).abs()[resp]
                metrics.update({"logprob_gap_sum": d.double().sum(), "logprob_gap_tokens": torch.tensor(d.numel()),
                                "logprob_gap_max": d.max() if d.numel() else torch.zeros(())})
            if use_kl:
                kl = kl_estimate(lp, f["ref_logprob"], s["kl_loss_type"])
                loss = loss + s["kl_loss_coef"] * (w * kl).sum()
                metrics["kl_loss"] = (w * kl).sum()
            if ent is not None:
                if entropy_coeff != 0.0:
                    loss = loss - entropy_coeff * (w * ent).sum()
                metrics["entropy"] = (w * ent.detach()).sum()
            return loss, metrics

        # the entropy is computed also without its bonus, as a metric: one more pass over the logits
        # of the response tokens (exp and two sums per vocabulary entry, TP-reduced), no graph
        return self._minibatch_steps(batch, num_minibatches, epochs, fields, loss_fn,
                                     need_entropy=True, after_step=steps_done, entropy_grad=entropy_coeff != 0.0)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0)
    def update_critic(self, batch: Batch, num_minibatches: int = 1, epochs: int = 1) -> dict[str, float]:
        """Clipped value loss. Fields: old_values, returns, loss_weight."""
        clip = float(self.section["cliprange_value"])

        def loss_fn(values: torch.Tensor, ent: Any, f: dict[str, torch.Tensor]):
            w = f["loss_weight"] * f["label_mask"]
            vl, clipped = value_loss(values, f["old_values"], f["returns"], clip)
            return (w * vl).sum(), {"vf_loss": (w * vl).sum(), "vf_clipfrac": (w * clipped.float()).sum()}

        return self._minibatch_steps(batch, num_minibatches, epochs, ["old_values", "returns"], loss_fn)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def record_gradients(self, on: bool = True) -> None:
        """Keep every optimizer step's gradient (before clipping) for `recorded_gradients` (tests)."""
        self.engine.record_grads = [] if on else None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def recorded_gradients(self) -> list[dict[str, torch.Tensor]] | None:
        """HF-named gradients of each recorded step: from TP rank 0 of every stage of DP replica 0
        (the controller merges the stages' dicts), None elsewhere. A TP collective."""
        e = self.engine
        steps = [e.export_hf_stage(g) for g in e.record_grads or []]
        return steps if e.replica_rank == 0 and e.tp_rank == 0 else None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def hf_weights(self, adapters: bool = True) -> dict[str, torch.Tensor] | None:
        """The current weights HF-named (a critic's head as value_head.*), from TP rank 0 of every
        stage of DP replica 0 (the controller merges the stages' dicts), None elsewhere. With LoRA:
        merged with the adapters, or (adapters=False) the frozen base."""
        e = self.engine
        with self._adapters(adapters):
            stage = e.export_hf_stage(e.megatron_shard())
        return stage if e.replica_rank == 0 and e.tp_rank == 0 else None

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def lora_adapters(self) -> dict[str, torch.Tensor] | None:
        """The LoRA adapters PEFT-named (hpcrl.engines.megatron.lora.adapters_to_hf), from TP rank 0 of
        every stage of DP replica 0, None elsewhere (a TP collective). `write_peft_folder` writes them."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        e = self.engine
        if e.lora is None:
            raise ValueError("lora_adapters: this actor has no LoRA adapters (actor.lora.rank is 0)")
        if self.engine_kind == "fsdp":  # PEFT's own adapters (hpcrl.engines.fsdp.lora), gathered by every rank
            adapters = e.peft_adapters()
            return adapters if e.dp_rank == 0 else None
        mine = {k: v.cpu() for k, v in e.adapter_shard().items()}
        shards = [mine]
        if e.tp_size > 1:
            shards = [None] * e.tp_size
            dist.all_gather_object(shards, mine, group=ps.get_tensor_model_parallel_group())
        if e.replica_rank != 0 or e.tp_rank != 0:
            return None
        return adapters_to_hf(e.arch, shards, e.pp_rank, e.pp_size)

    # weights -----------------------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def export_hf(self, out_dir: str) -> None:
        """Write the model as a HF folder: one safetensors file per pipeline stage (written by that
        stage's TP rank 0 of DP replica 0) plus the index, config and tokenizer files."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        e = self.engine
        stage = e.export_hf_stage()  # a TP collective: every rank takes part
        out = Path(out_dir)
        writer = e.replica_rank == 0 and e.tp_rank == 0
        name = f"model-{e.pp_rank + 1:05d}-of-{e.pp_size:05d}.safetensors"
        if writer:
            out.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in stage.items()}, str(out / name), metadata={"format": "pt"})
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(stage) if writer else None)
        if writer and e.pp_rank == 0:
            weight_map = {k: f"model-{self._stage_of_rank(r) + 1:05d}-of-{e.pp_size:05d}.safetensors"
                          for r, keys in enumerate(names) if keys for k in keys}
            (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                         indent=1))
            for f in Path(self.model_path).iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                    shutil.copy2(f, out / f.name)
        dist.barrier()

    def _stage_of_rank(self, rank: int) -> int:
        """Pipeline stage of a torch.distributed rank in megatron's order (TP fastest, then CP, DP, PP)."""
        e = self.engine
        return rank // (e.tp_size * e.replicas)

    # checkpoints (hpcrl.checkpoint, docs/checkpoint.md) ----------------------------------------
    def _checkpointer(self) -> Any:
        from hpcrl.checkpoint.fsdp_state import FsdpCheckpointer
        from hpcrl.checkpoint.megatron_state import RoleCheckpointer

        if getattr(self, "_ckpt", None) is None:
            kind = FsdpCheckpointer if self.engine_kind == "fsdp" else RoleCheckpointer
            self._ckpt = kind(self.engine, self.role, self.model_path)
        return self._ckpt

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def save_checkpoint(self, ckpt_dir: str, async_save: bool = False) -> list[dict[str, Any]]:
        """Write this rank's part of the role into the (temporary) checkpoint folder: its shard
        with optimizer state if it is in DP replica 0, its RNG states always. Returns the file
        records for the manifest; [] for async_save (they come from wait_checkpoint)."""
        return self._checkpointer().save(ckpt_dir, async_save)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def checkpoint_nbytes(self) -> int:
        """~Bytes this rank's save_checkpoint will write (from tensor sizes, nothing copied): the
        controller sums them over the ranks to refuse a save that cannot fit before it starts."""
        return self._checkpointer().nbytes()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def wait_checkpoint(self) -> list[dict[str, Any]]:
        """Finish an async save; its file records ([] when none is in flight)."""
        return self._checkpointer().wait()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, ckpt_dir: str, seed: int | None = None) -> dict[str, Any]:
        """Load the role from a committed checkpoint folder, converting when it was saved in another
        layout (then RNGs are reseeded from seed, default trainer.seed of its config.yaml, and the
        step). An actor with a rollout engine must reshard to it afterwards."""
        return self._checkpointer().load(ckpt_dir, seed)

    # =============================================================================================
    # DPO (the loop: hpcrl.trainer.dpo; the loss: hpcrl.algos.dpo)
    #
    # A DPO batch holds both responses of each preference pair as rows (prompt + response,
    # right-padded; response_mask marks the response, EOS included), with `pair_index` (the pair's
    # number in the step), `chosen` (1: the chosen response, 0: the rejected one) and, for the
    # update, `ref_logp` (the reference's summed response log-prob of the row). Log-probs are at
    # T = 1 whatever rollout.temperature says: DPO scores the model's own distribution.
    # =============================================================================================
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def set_schedule_steps(self, optimizer_steps: int) -> None:
        """The LR schedule's length in optimizer steps (the constructor counts the RL loop's
        mini-batches x epochs; DPO takes one optimizer step per training step)."""
        if self.engine.optim is not None:
            self.engine.optim.total_steps = int(optimizer_steps)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def seed_host_rngs(self, seed: int) -> None:
        """Seed this process's Python and NumPy generators from (seed, rank). In the RL loop the
        colocated vLLM engine seeds them; a DPO run has none, and generators left at their
        OS-entropy start would make the RNG files of two identical runs differ (a resume test
        compares them byte for byte). torch's generators are seeded by the layout set-up."""
        import random

        import numpy as np
        import torch.distributed as dist

        from hpcrl.checkpoint.rng import rank_seed

        r = rank_seed(int(seed), 0, dist.get_rank())
        random.seed(r)
        np.random.seed(r)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def sequence_logprobs(self, batch: Batch, adapters: bool = True) -> torch.Tensor | None:
        """Sum of each row's response-token log-probs [B] (float64) under this model, T = 1;
        adapters=False: under the frozen base of a LoRA actor."""
        if len(batch) == 0:  # a DP shard of a batch with fewer rows than DP ranks
            return torch.zeros(0, dtype=torch.float64) if self.engine.is_output_rank else None
        seqs = sequences(batch)
        positions = [m > 0 for m in to_label_aligned(batch, "response_mask", seqs)]
        with self._adapters(adapters):
            lp = self.engine.compute_logprob(seqs, 1.0, positions)
        if lp is None or not self.engine.is_output_rank:
            return None
        return torch.stack([v.double().sum() for v in lp])

    def _pairs_apart(self, seqs: list[torch.Tensor], fields: dict[str, list[torch.Tensor]],
                     chosen_rows: torch.Tensor, rejected_rows: torch.Tensor) -> torch.Tensor:
        """Per pair: whether the engine's micro-batch plan for these sequences and fields puts its
        two rows into different micro-batches. The plan is a function of its inputs, so it is the
        one train_step runs next, and the same on every rank of this DP replica."""
        where: dict[int, int] = {}
        for m, mb in enumerate(self.engine._micro_batches(seqs, fields)):
            for p in mb.placement:
                where[p.seq] = m
        return torch.tensor([where[c] != where[r] for c, r in zip(chosen_rows.tolist(), rejected_rows.tolist(),
                                                                   strict=True)], dtype=torch.bool)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0)
    def update_dpo(self, batch: Batch, num_pairs: int, beta: float, loss_type: str = "sigmoid",
                   label_smoothing: float = 0.0) -> dict[str, float]:
        """One optimizer step of DPO / IPO (hpcrl.algos.dpo) on this rank's pairs. The loss is the
        mean over the step's `num_pairs` pairs (all DP ranks together), and so are the metrics.

        Per-sequence sums inside the engine's per-micro-batch loss: loss_fn gets the per-token
        log-probs of one micro-batch laid out like labels, with a per-token field `dpo_row` (the
        row's number + 1 on each of its tokens), and sums each row's response tokens there
        (index_add). A row is never cut: a sequence (or its branch after a shared prompt) sits
        whole in one micro-batch, which loss_fn checks against the row's response token count.

        A pair is exact in one pass when its two rows share a micro-batch. The packing keeps them
        together when they share their prompt (actor.share_prompt: one unit) and fit in
        actor.micro_batch_tokens. Where the plan puts them apart (a longer pair, share_prompt off,
        Transformer Engine), a forward without gradient first sums every row under the same
        weights; the micro-batch that holds one row of a split pair takes the other row's sum from
        it, a constant, so the gradient it gives its own row's tokens is exactly dL/d(its sum), and
        the pair's loss value is shared between its two micro-batches (L/2 each, gradient whole).
        DP: every rank must hold whole pairs (data.train_batch_size is a multiple of the DP size),
        checked here; gradients are summed over DP. The update is the same for any micro-batching
        and DP size, up to float rounding."""
        from hpcrl.algos.dpo import dpo_loss, dpo_pair_stats

        seqs = sequences(batch)
        n = len(seqs)
        chosen_rows, rejected_rows = dpo_pair_rows(batch["pair_index"], batch["chosen"])
        ref = batch["ref_logp"].double()
        response = [m > 0 for m in to_label_aligned(batch, "response_mask", seqs)]
        response_tokens = torch.tensor([int(m.sum()) for m in response])
        if bool((response_tokens == 0).any()):
            raise ValueError("update_dpo: a row has no response token (every response ends with EOS)")
        # loss_weight marks the positions the loss reads (the engine computes logits there only, and
        # packs the prompt once before them); the pairs' weights are applied in loss_fn
        fields = {"loss_weight": [m.float() for m in response],
                  "dpo_row": [torch.full(m.shape, i + 1, dtype=torch.long) for i, m in enumerate(response)]}
        apart = self._pairs_apart(seqs, fields, chosen_rows, rejected_rows)
        other: torch.Tensor | None = None  # every row's sum from the forward without gradient
        if bool(apart.any()):
            lp = self.engine.compute_logprob(seqs, 1.0, response)
            if lp is not None:  # the last pipeline stage, where loss_fn runs
                other = torch.stack([v.double().sum() for v in lp])

        def loss_fn(lp: torch.Tensor, ent: Any, f: dict[str, torch.Tensor]):
            dev = lp.device
            sel = (f["loss_weight"] > 0) & f["label_mask"].bool()
            row = f["dpo_row"][sel].long() - 1
            sums = torch.zeros(n, dtype=torch.float64, device=dev).index_add(0, row, lp[sel].double())
            seen = torch.bincount(row, minlength=n).cpu()
            present = seen > 0
            if not torch.equal(seen[present], response_tokens[present]):
                raise RuntimeError("update_dpo: a row's response tokens were cut across micro-batches; its "
                                   "log-prob sum would be partial")
            c_in, r_in = present[chosen_rows], present[rejected_rows]
            here = torch.nonzero(c_in | r_in).flatten()
            both = (c_in & r_in)[here]
            if not bool(both.all()) and other is None:
                raise RuntimeError("update_dpo: a pair split across micro-batches without its forward pass")
            c, r = chosen_rows[here].to(dev), rejected_rows[here].to(dev)
            fill = other.to(dev) if other is not None else sums.detach()
            pc = torch.where(c_in[here].to(dev), sums[c], fill[c])
            pr = torch.where(r_in[here].to(dev), sums[r], fill[r])
            ref_c, ref_r = ref.to(dev)[c], ref.to(dev)[r]
            # micro-batches holding the pair's rows: 1, or 2 for a split pair (each counts half its value)
            k = 2.0 - both.double().to(dev)
            losses = dpo_loss(pc, pr, ref_c, ref_r, beta, loss_type, label_smoothing,
                              response_tokens[chosen_rows[here]].to(dev), response_tokens[rejected_rows[here]].to(dev))
            loss = (losses - (1.0 - 1.0 / k) * losses.detach()).sum() / num_pairs
            share = 1.0 / (k * num_pairs)
            metrics = {name: (share * v).sum() for name, v in dpo_pair_stats(pc, pr, ref_c, ref_r, beta).items()}
            metrics["pairs_split"] = (share * num_pairs * (k - 1.0)).sum()  # sums to 1 per split pair
            return loss.float(), metrics

        m = self.engine.train_step(seqs, fields, loss_fn, temperature=1.0)
        out = {k: v for k, v in m.items() if not k.startswith("nonfinite_")}
        # named as the RL updates name them: the trainer stops at trainer.max_nonfinite_steps in a row
        out.update(optimizer_steps=1.0, nonfinite_steps_skipped=m["nonfinite_skipped"],
                   nonfinite_steps_in_a_row=m["nonfinite_in_a_row"])
        return out


def dpo_pair_rows(pair_index: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row of the chosen and of the rejected response of each pair in a batch (one DP shard),
    pairs in order of first appearance. ValueError unless each pair has exactly one of each here:
    a pair cut between DP ranks could not be scored on either."""
    order: dict[int, list[int]] = {}
    for row, p in enumerate(pair_index.tolist()):
        order.setdefault(int(p), []).append(row)
    chosen_rows, rejected_rows = [], []
    flags = chosen.tolist()
    for p, rows in order.items():
        kinds = sorted(bool(flags[r]) for r in rows)
        if kinds != [False, True]:
            raise ValueError(f"DPO pair {p}: this rank holds {len(rows)} of its rows (chosen flags {kinds}); each "
                             "pair needs its chosen and its rejected row on the same DP rank (data.train_batch_size "
                             "a multiple of the DP size, the two rows next to each other)")
        chosen_rows.append(next(r for r in rows if flags[r]))
        rejected_rows.append(next(r for r in rows if not flags[r]))
    return torch.tensor(chosen_rows, dtype=torch.long), torch.tensor(rejected_rows, dtype=torch.long)


class FrozenBase:
    """The reference policy of a LoRA run: the actor group's own frozen base, its adapters switched
    off for the call (no second model copy). Offers what the trainers ask of a reference group."""

    name = "reference (the actor's base, adapters off)"

    def __init__(self, actor: Any):
        self.actor = actor

    def compute_logprob(self, batch: Batch, response_only: bool = False) -> torch.Tensor:
        return self.actor.compute_logprob(batch, response_only=response_only, adapters=False)

    def sequence_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.actor.sequence_logprobs(batch, adapters=False)
