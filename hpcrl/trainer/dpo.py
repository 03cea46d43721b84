"""DPO (and IPO) on the Megatron engine, on the same controller and run machinery as the RL loop.

One step, as the controller sees it (every call runs SPMD on the worker groups)::

    pairs = [train_data[i] for i in sampler.next_batch()]     # data.train_batch_size preference pairs
    batch = preference_batch(pairs)                            # rows: prompt+chosen, prompt+rejected, ...
    batch["ref_logp"] = reference.sequence_logprobs(batch)     # frozen reference, summed over each response
    metrics = actor.update_dpo(batch, num_pairs, beta, ...)    # one optimizer step on all pairs

The actor and the reference are the RL loop's Megatron roles (hpcrl.workers.megatron_roles,
colocated on every worker, one layout); there is no rollout engine, reward or critic. The two rows
of a pair begin with the same prompt ids (hpcrl.data.preference), sit next to each other, and every
DP rank gets whole pairs; the engine packs each pair's prompt once and sums each response's
log-probs inside its per-micro-batch loss (MegatronRole.update_dpo says how that stays exact for
any micro-batching). The loss and its metrics are hpcrl.algos.dpo.

Validation (before step 1, every `trainer.val_every` steps, and after the last step, as in the RL
loop): the held-out pairs scored under the policy, against the reference's scores of them (computed
once: the reference is frozen), giving val/loss and the preference accuracies val/rewards/accuracies
(implicit reward of chosen > rejected) and val/logps/accuracies (the policy's own log-prob of chosen >
rejected).

Everything around the loop is hpcrl.trainer.main's, as for the RL runs: resume from the latest
checkpoint, saves every `checkpoint.save_every` steps (the actor's weights, optimizer state and
RNG; the sampler position), preemption (USR1/TERM/time limit: save, requeue, resume), the NaN/Inf
stop, metrics.jsonl and validation.jsonl, and one line per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from hpcrl.algos.dpo import dpo_metrics
from hpcrl.config.derived import engine_summary
from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch
from hpcrl.data import PreferenceDataset, PreferencePair, ShuffledSampler, iterate_batches
from hpcrl.trainer.metrics import PhaseTimer, peak_memory_metrics
from hpcrl.workers.megatron_roles import FrozenBase, MegatronRole

log = logging.getLogger("hpcrl.trainer")


def preference_batch(pairs: Sequence[PreferencePair]) -> Batch:
    """The wire format (hpcrl.workers.batching) of pairs: row 2i = prompt + chosen of pair i, row
    2i + 1 = prompt + rejected, right-padded; response_mask marks the responses (EOS included);
    pair_index [2N] and chosen [2N] (1 / 0) say which row is which."""
    seqs = [(p.prompt_ids, resp) for p in pairs for resp in (p.chosen_ids, p.rejected_ids)]
    width = max(len(q) + len(r) for q, r in seqs)
    n = len(seqs)
    ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    resp = torch.zeros(n, width)
    for i, (q, r) in enumerate(seqs):
        end = len(q) + len(r)
        ids[i, :end] = torch.tensor(q + r)
        attn[i, :end] = 1
        resp[i, len(q):end] = 1
    return Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                  "pair_index": torch.arange(len(pairs)).repeat_interleave(2),
                  "chosen": torch.tensor([1, 0]).repeat(len(pairs))})


def validation_batches(num_pairs: int, batch_size: int, min_pairs: int) -> list[list[int]]:
    """Pair indices of each validation batch, in order: `batch_size` pairs each, a short last batch
    joined to the one before when it has fewer than `min_pairs` (so that every DP rank gets a row)."""
    batches = list(iterate_batches(range(num_pairs), batch_size))
    if len(batches) > 1 and len(batches[-1]) < min_pairs:
        last = batches.pop()
        batches[-1] = batches[-1] + last
    return batches


class DPOTrainer:
    """Builds the actor and reference groups of a config and runs DPO steps (hpcrl.trainer.main drives it)."""

    def __init__(self, cfg: DictConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.plain: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # what travels to workers
        self.dpo = cfg.algorithm.dpo
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        d = cfg.data

        def load(files: Sequence[str]) -> PreferenceDataset:
            return PreferenceDataset(list(files), self.tokenizer, d.prompt_key, d.chosen_key, d.rejected_key,
                                     d.max_prompt_length, d.max_response_length, d.max_skipped_row_share)

        self.train_data = load(d.train_files)
        self.val_data = load(d.val_files) if d.val_files and cfg.trainer.val_every else None
        self.sampler = ShuffledSampler(len(self.train_data), d.train_batch_size, d.seed, d.shuffle)
        self.kl_ctrl = None  # DPO's KL to the reference is implicit (beta): no controller to checkpoint
        self.step = 0  # optimizer steps of the loop done so far (the step counter of checkpoints)
        # the reference's log-prob sums of the validation pairs: the reference never changes, and a
        # resumed run recomputes them from the same batches (the same numbers)
        self._val_ref: torch.Tensor | None = None

        t = time.perf_counter()
        log.info("building the actor and reference groups (%s): DPO, beta %g, loss %s",
                 engine_summary(cfg), self.dpo.beta, self.dpo.loss_type)
        self.actor = WorkerGroup(MegatronRole, init_kwargs={"cfg": self.plain, "role": "actor"}, name="actor")
        # with LoRA the reference is the actor's frozen base, adapters off (no second copy)
        self.reference = (FrozenBase(self.actor) if cfg.actor.lora.rank else
                          WorkerGroup(MegatronRole, init_kwargs={"cfg": self.plain, "role": "reference"},
                                      name="reference"))
        self.actor.set_schedule_steps(int(cfg.trainer.total_steps))
        self.actor.seed_host_rngs(int(cfg.trainer.seed))  # a resume restores the saved streams over these
        self.dp_size = self.actor.layout.dp_size
        where = self.actor.describe()
        log.info("worker groups ready in %.1f s: actor, reference (actor rank 0: %s %s, %d torch thread(s))",
                 time.perf_counter() - t, where["device"], where["dtype"], where["torch_threads"])

    def groups(self) -> list[WorkerGroup | FrozenBase]:
        return [self.actor, self.reference]

    def trained_groups(self) -> list[WorkerGroup]:
        """What a checkpoint must hold: the frozen reference reloads from model.path."""
        return [self.actor]

    def _loss_settings(self) -> dict[str, Any]:
        return {"beta": float(self.dpo.beta), "loss_type": str(self.dpo.loss_type),
                "label_smoothing": float(self.dpo.label_smoothing)}

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.val_data is not None and (step - 1) % self.cfg.trainer.val_every == 0:
            with timer("validate"):
                metrics.update(self.validate())
        pairs = [self.train_data[i] for i in self.sampler.next_batch()]
        batch = preference_batch(pairs)
        with timer("ref_logprob"):
            batch["ref_logp"] = self.reference.sequence_logprobs(batch)
        with timer("update_actor"):
            out = self.actor.update_dpo(batch, num_pairs=len(pairs), **self._loss_settings())
        for key in ("grad_norm", "lr", "optimizer_steps", "nonfinite_steps_skipped", "nonfinite_steps_in_a_row"):
            metrics[f"actor/{key}"] = out.pop(key)
        metrics.update({f"dpo/{k}": v for k, v in out.items()})
        # every worker process hosts an actor rank (the reference is colocated with it)
        metrics.update(peak_memory_metrics(self.actor.peak_memory(), self.actor.ranks))
        step_s = time.perf_counter() - t0
        lengths = batch["response_mask"].sum(-1)
        metrics.update({
            "response_length/chosen_mean": float(lengths[0::2].float().mean()),
            "response_length/rejected_mean": float(lengths[1::2].float().mean()),
            "prompt_length/mean": float((batch["attention_mask"].sum(-1) - lengths)[0::2].float().mean()),
            "data/epoch": float(self.sampler.state_dict()["epoch"]),
            "time/step": step_s, "throughput/tokens_per_s": float(batch["attention_mask"].sum()) / step_s,
            **{f"time/{k}": v for k, v in timer.seconds.items()},
        })
        return metrics

    def validate(self) -> dict[str, float]:
        """DPO loss and preference accuracies of the policy on the validation pairs (val/*)."""
        assert self.val_data is not None
        limit = min(self.cfg.data.val_max_samples or len(self.val_data), len(self.val_data))
        # at least one row per DP rank in every batch (a pair is two rows)
        index = validation_batches(limit, self.cfg.data.val_batch_size, -(-self.dp_size // 2))
        batches = [preference_batch([self.val_data[i] for i in idx]) for idx in index]
        policy = torch.cat([self.actor.sequence_logprobs(b) for b in batches])
        if self._val_ref is None or len(self._val_ref) != len(policy):
            self._val_ref = torch.cat([self.reference.sequence_logprobs(b) for b in batches])
        ref = self._val_ref
        tokens = torch.cat([b["response_mask"].sum(-1) for b in batches])  # IPO averages over them
        m = dpo_metrics(policy[0::2], policy[1::2], ref[0::2], ref[1::2], **self._loss_settings(),
                        chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2])
        out = {f"val/{k}": v for k, v in m.items()}
        log.info("validation after %d step(s): %s", self.step, ", ".join(f"{k} {v:.4f}" for k, v in out.items()))
        return out

    def final_validation(self) -> dict[str, float]:
        """The validation after the last step."""
        return self.validate()

    def close(self) -> None:
        """Nothing to release beyond what the runtime's shutdown does (no rollout engine, no scorer)."""
