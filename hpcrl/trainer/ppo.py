"""The PPO family on one controller: PPO with a critic (GAE), GRPO, RLOO, REINFORCE++, ReMax, DAPO.

One step, as the controller sees it (every call below runs SPMD on the worker groups)::

    placement.to_rollout()                    # trainer weights -> vLLM (hpcrl.trainer.placement)
    batch = generate(rollout, prompts)        # n samples per prompt (+ DAPO refills)
    scores = reward(batch)                    # rule-based / custom / reward model
    placement.to_training()
    old_logprob = actor.compute_logprob(batch)            # unless on-policy or from the rollout
    ref_logprob = reference.compute_logprob(batch)        # when a KL term is used
    values = critic.compute_values(batch)                 # gae
    advantages = estimator(scores, values, ...)
    critic.update_critic(...); actor.update_actor(...)    # mini-batches x epochs

The estimators and losses are plain functions (hpcrl.algos); the algorithms differ only in
`algorithm.adv_estimator`, `algorithm.policy_loss` and a few switches, so one loop serves them all.

With the split placement and rollout.max_staleness > 0, `generate` is replaced by a batch generated
ahead (hpcrl.trainer.ahead): the next batch is generated on the engines while this one trains, and
collected after the update, before the new weights are sent.

With rollout.multi_turn.enable, `generate` is the multi-turn loop of hpcrl.agents.rollout (tools
called between the model's turns); it returns the same batch, whose response_mask leaves the tool
tokens out, so nothing after generation knows that turns existed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from hpcrl.algos.advantages import compute_advantages, masked_mean, token_level_rewards
from hpcrl.algos.kl_control import make_kl_controller
from hpcrl.algos.losses import kl_estimate, truncated_is_weights
from hpcrl.algos.sampling import groups_with_signal, overlong_penalty
from hpcrl.config import critic_enabled, reference_enabled
from hpcrl.config.derived import engine_summary, rollout_mode, staleness_depth
from hpcrl.controller import WorkerGroup
from hpcrl.controller.batch import Batch
from hpcrl.data import PromptDataset, PromptRow, ShuffledSampler, iterate_batches
from hpcrl.engines.vllm.engine import SEED_SPACE, SamplingSettings
from hpcrl.rewards import RewardInput, RewardScorer
from hpcrl.trainer.ahead import Generated, RolloutsAhead
from hpcrl.trainer.metrics import (
    PhaseTimer,
    distribution_metrics,
    peak_memory_metrics,
    per_source_metrics,
    phase_throughput,
)
from hpcrl.trainer.placement import make_placement
from hpcrl.trainer.progress import advance
from hpcrl.workers.actor_rollout import generate, generate_each, logprob_gap, start_generate
from hpcrl.workers.batching import arrange_minibatches
from hpcrl.workers.megatron_roles import FrozenBase, MegatronRole

log = logging.getLogger("hpcrl.trainer")


def pad_concat(batches: Sequence[Batch]) -> Batch:
    """Concatenate wire-format batches of different widths (right padding with zeros)."""
    width = max(b["input_ids"].shape[1] for b in batches)
    padded = []
    for b in batches:
        grow = width - b["input_ids"].shape[1]
        if grow:
            # token-aligned fields are [B, S, ...] (routed_experts: [B, S, layers, k]): pad dim 1
            b = Batch({k: torch.nn.functional.pad(b[k], (0, 0) * (b[k].dim() - 2) + (0, grow)) if b[k].dim() >= 2
                       else b[k] for k in b.keys()})
        padded.append(b)
    return Batch.concat(padded)


@dataclass
class Sampled:
    """A generated batch and what scoring it needs besides its tokens."""

    batch: Batch
    # per sample: the completion was cut by a token limit (None: it reached max_new_tokens without EOS)
    truncated: list[bool] | None = None
    # per sample: merged into the reward's extra_info (multi-turn: {"multi_turn": {...}})
    reward_extra: list[dict[str, Any]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class PPOTrainer:
    """Builds the worker groups of a config and runs its training steps."""

    def __init__(self, cfg: DictConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.plain: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # what travels to workers
        self.algo = cfg.algorithm
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        d = cfg.data
        self.agent = None  # the multi-turn loop (hpcrl.agents.rollout), with rollout.multi_turn.enable
        # every sandboxed program of the run (python tool, code reward) hides the data and run folders
        from hpcrl.sandbox.reward import hide_run_paths_from_programs

        hide_run_paths_from_programs(self.plain)
        prompt_kwargs: dict[str, Any] = {}
        mt = cfg.rollout.multi_turn
        if mt.enable:
            from hpcrl.agents.rollout import MultiTurnRollout, system_prompt_with_tools

            self.agent = MultiTurnRollout.from_config(self.plain["rollout"]["multi_turn"], self.tokenizer)
            schemas = self.agent.tools.schemas()
            prompt_kwargs = {"tools": schemas if mt.tools_in_prompt else None,
                             "system_prompt": system_prompt_with_tools(mt.system_prompt, schemas)}
        self.train_data = PromptDataset(list(d.train_files), self.tokenizer, d.prompt_key, d.max_prompt_length,
                                        d.max_skipped_row_share, **prompt_kwargs)
        self.val_data = (PromptDataset(list(d.val_files), self.tokenizer, d.prompt_key, d.max_prompt_length,
                                       d.max_skipped_row_share, **prompt_kwargs)
                         if d.val_files and cfg.trainer.val_every else None)
        self.sampler = ShuffledSampler(len(self.train_data), d.train_batch_size, d.seed, d.shuffle)
        self.scorer = RewardScorer(cfg.reward.function, cfg.reward.timeout_s, cfg.reward.format_weight)
        self.kl_ctrl = make_kl_controller(self.plain["algorithm"]["kl_ctrl"])
        self.step = 0  # optimizer steps of the loop done so far (the step counter of checkpoints)

        t = time.perf_counter()
        log.info("building the actor and rollout groups (%s placement, %s, vLLM rollout TP=%d)",
                 cfg.trainer.placement, engine_summary(cfg), cfg.rollout.tensor_parallel)
        self.placement = make_placement(self.plain)
        self.actor = self.placement.actor
        on = self.placement.trainer_ranks  # the other roles live with the actor
        self.reference: WorkerGroup | FrozenBase | None = None
        if reference_enabled(cfg):  # with LoRA the reference is the actor's frozen base, adapters off
            self.reference = (FrozenBase(self.actor) if cfg.actor.lora.rank else
                              WorkerGroup(MegatronRole, ranks=on, init_kwargs={"cfg": self.plain, "role": "reference"},
                                          name="reference"))
        self.critic = (WorkerGroup(MegatronRole, ranks=on, init_kwargs={"cfg": self.plain, "role": "critic"},
                                   name="critic")
                       if critic_enabled(cfg) else None)
        self.reward_model = None
        if cfg.reward.model_path:
            from hpcrl.workers.reward_model import RewardModelRole

            self.reward_model = WorkerGroup(RewardModelRole, ranks=on, init_kwargs={"cfg": self.plain},
                                            name="reward_model")
        # batches generated ahead of their step (split placement, rollout.max_staleness > 0)
        self.ahead = RolloutsAhead(staleness_depth(cfg))
        # the engines generating without pause (rollout.mode=fully_async): hpcrl.trainer.stream
        self.stream = None
        if rollout_mode(cfg) == "fully_async":
            from hpcrl.pools.registry import open_pools
            from hpcrl.trainer.stream import make_stream

            # rollout pools of other Slurm jobs may join and leave (hpcrl.pools)
            self.placement.pools = open_pools(cfg, self.placement.trainer_ranks[0])
            self.stream = make_stream(cfg, self.plain["rollout"], self.placement.rollout, lambda: [
                (int(i), self.train_data[i].prompt_ids) for i in self.sampler.next_batch()],
                pools=self.placement.pools)
        self.dp_size = self.actor.layout.dp_size
        where = self.actor.describe()
        layout = ("FSDP " if where["engine"] == "fsdp" else "") + (
                  f"TP={where['tp']} PP={where['pp']}" + (f" CP={where['cp']}" if where["cp"] > 1 else "")
                  + (f" EP={where['ep']}" if where["ep"] > 1 else "")
                  + f" DP={where['dp']}" + (" SP" if where["sequence_parallel"] else "")
                  + (f", MoE {where['experts']} experts" if where["experts"] else "")
                  + (f", recompute {where['recompute']}" if where["recompute"] != "none" else ""))
        log.info("worker groups ready in %.1f s: %s (actor %s; rank 0: %s %s, %d torch thread(s), CPUs %s, "
                 "torch.compile %s)",
                 time.perf_counter() - t, ", ".join(g.name for g in self.groups()), layout, where["device"],
                 where["dtype"], where["torch_threads"], where["cpu_affinity"],
                 "on" if where["torch_compile"] else "off")

    def groups(self) -> list[WorkerGroup | FrozenBase]:
        rollout = self.placement.rollout if self.placement.rollout is not self.actor else None
        return [g for g in (self.actor, rollout, self.reference, self.critic, self.reward_model) if g is not None]

    def trained_groups(self) -> list[WorkerGroup]:
        """What a checkpoint must hold: the frozen reference and reward model reload from their paths."""
        return [g for g in (self.actor, self.critic) if g is not None]

    # rollout -----------------------------------------------------------------------------------
    def _seed(self, step: int, round_: int = 0) -> int:
        """Sampling seed of a step's generation round: the per-sample seeds are seed + sample index
        (SamplingSettings.seed), so each step and round starts at a hashed point of a 2^62 space
        (their ranges of a few thousand seeds do not meet), and a resumed run samples the same
        completions as an uninterrupted one."""
        key = f"{int(self.cfg.trainer.seed)}/{step}/{round_}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % SEED_SPACE

    def _old_logprob_source(self, samples: int) -> str:
        """recompute (a separate actor forward), rollout (vLLM's log-probs) or current (on-policy:
        the update's own forward, detached); see actor.old_logprob."""
        a = self.cfg.actor
        if a.old_logprob != "auto":
            return a.old_logprob
        on_policy = samples // a.ppo_mini_batch_size == 1 and a.ppo_epochs == 1
        # a batch generated ahead came from older weights than the trainer's, and the truncated
        # importance weights compare the trainer's old log-probs with the rollout's
        stale = self.ahead.depth > 0 or self.stream is not None or self.algo.rollout_correction != "none"
        return "current" if on_policy and not self.algo.use_kl_in_reward and not stale else "recompute"

    def _shuffle_seed(self, step: int, role: str) -> int | None:
        """Seed of the step's mini-batch shuffle for a role (None: in rollout order); a function of
        trainer.seed and the step only, so a resumed run cuts the same mini-batches."""
        if not self.cfg[role].shuffle_minibatches:
            return None
        key = f"{int(self.cfg.trainer.seed)}/{step}/{role}/minibatches".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % SEED_SPACE

    def _responses(self, batch: Batch) -> tuple[list[list[int]], torch.Tensor]:
        """Generated token ids of every row and their lengths."""
        mask = batch["response_mask"].bool()
        ids = [batch["input_ids"][i][mask[i]].tolist() for i in range(len(batch))]
        return ids, mask.sum(-1)

    def sample(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> Sampled:
        """Generate on the rollout engines: one turn (`generate`), or conversations with tools
        (rollout.multi_turn) in the same wire format."""
        if self.agent is None:
            return Sampled(generate(self.placement.rollout, prompts, sampling))
        out = self.agent.generate(partial(generate_each, self.placement.rollout), prompts, sampling)
        return Sampled(out.batch, out.truncated, [{"multi_turn": x} for x in out.reward_extra(self.tokenizer)],
                       out.metrics)

    def score(self, sampled: Sampled, rows: Sequence[PromptRow], n: int, max_new_tokens: int
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """Sample-level rewards [B] of a generated batch (row r answers prompt rows[r // n]). The
        response is the model's own tokens (response_mask): in a multi-turn sample its turns, without
        the tool answers between them (those are in extra_info["multi_turn"]["transcript"])."""
        batch = sampled.batch
        ids, lengths = self._responses(batch)
        eos = self.tokenizer.eos_token_id
        truncated = sampled.truncated or [len(t) >= max_new_tokens and (not t or t[-1] != eos) for t in ids]
        extra = sampled.reward_extra or [{}] * len(ids)
        items = [RewardInput(data_source=rows[r // n].data_source,
                             response=self.tokenizer.decode(t, skip_special_tokens=True),
                             ground_truth=rows[r // n].ground_truth, extra_info={**rows[r // n].extra_info, **extra[r]},
                             prompt=rows[r // n].prompt_text, truncated=truncated[r])
                 for r, t in enumerate(ids)]
        result = self.scorer.score(items)
        scores = torch.tensor(result.scores, dtype=torch.float32)
        metrics = dict(result.metrics)
        accs = [d.get("acc") for d in result.details if d.get("acc") is not None]
        if accs:
            metrics["reward/acc"] = float(sum(float(a) for a in accs) / len(accs))
        if self.reward_model is not None:
            rm = self.reward_model.compute_scores(batch)
            metrics["reward/model_mean"] = float(rm.mean())
            scores = scores + rm.float()
        return scores, metrics

    def _generate_group(self, rows: Sequence[PromptRow], step: int, round_: int) -> tuple[Batch, torch.Tensor,
                                                                                          dict[str, float]]:
        r = self.cfg.rollout
        sampling = SamplingSettings.from_rollout_config(self.plain["rollout"], seed=self._seed(step, round_))
        sampled = self.sample([row.prompt_ids for row in rows], sampling)
        scores, metrics = self.score(sampled, rows, r.n, r.max_new_tokens)
        return sampled.batch, scores, {**metrics, **sampled.metrics}

    def rollout(self, step: int, timer: PhaseTimer) -> tuple[Batch, list[PromptRow], torch.Tensor, dict[str, float]]:
        """Sample the step's prompts, generate and score. With DAPO dynamic sampling, groups whose
        samples all got the same reward (no learning signal) are dropped and more prompts are
        drawn until the batch is full again or `max_refill_rounds` is spent (then the batch is
        topped up with dropped groups, which carry zero advantage)."""
        n, want = self.cfg.rollout.n, self.cfg.data.train_batch_size
        indices = self.sampler.next_batch()
        rows = [self.train_data[i] for i in indices]
        with timer("generate"):
            batch, scores, metrics = self._generate_group(rows, step, 0)
        if not self.algo.dynamic_sampling:
            # which rows of the training set the step learnt from and the seed its samples were drawn
            # with (a record of the data order, also across resumes and allocations)
            return batch, rows, scores, {**metrics, "data/prompt_rows": [int(i) for i in indices],
                                         "data/sampling_seeds": [self._seed(step, 0)]}
        kept: list[tuple[Batch, PromptRow, torch.Tensor]] = []
        spare: list[tuple[Batch, PromptRow, torch.Tensor]] = []
        rounds = 0
        while True:
            signal = groups_with_signal(scores, torch.arange(len(rows)).repeat_interleave(n))
            for g, row in enumerate(rows):
                part = (batch.select(list(range(g * n, (g + 1) * n))), row, scores[g * n:(g + 1) * n])
                (kept if signal[g * n] else spare).append(part)
            if len(kept) >= want or rounds >= self.algo.max_refill_rounds:
                break
            rounds += 1
            rows = [self.train_data[i] for i in self.sampler.next_batch()]
            with timer("generate"):
                batch, scores, _ = self._generate_group(rows, step, rounds)
        metrics["dapo/groups_with_signal"] = float(len(kept))
        metrics["dapo/refill_rounds"] = float(rounds)
        metrics["data/sampling_seeds"] = [self._seed(step, r) for r in range(rounds + 1)]
        parts = kept[:want] + spare[:max(want - len(kept), 0)]
        batch = pad_concat([p[0] for p in parts])
        batch["prompt_index"] = torch.arange(want).repeat_interleave(n)
        return batch, [p[1] for p in parts], torch.cat([p[2] for p in parts]), metrics

    def _start_rollout(self, step: int, version: int, indices: list[int] | None = None) -> Callable[[], Generated]:
        """Draw the prompts of `step`'s batch (or take `indices`: a saved batch regenerated) and start
        generating them on the engines, which run the weights after step `version`; returns at once.
        The function it returns waits for the samples and scores them."""
        r = self.cfg.rollout
        indices = self.sampler.next_batch() if indices is None else indices
        rows = [self.train_data[i] for i in indices]
        sampling = SamplingSettings.from_rollout_config(self.plain["rollout"], seed=self._seed(step, 0))
        wait = start_generate(self.placement.rollout, [row.prompt_ids for row in rows], sampling)

        def finish() -> Generated:
            sampled = Sampled(wait())
            scores, metrics = self.score(sampled, rows, r.n, r.max_new_tokens)
            return Generated(step, list(indices), sampled.batch, scores, metrics, version)

        return finish

    def rollout_ahead(self, step: int, timer: PhaseTimer) -> tuple[Batch, list[PromptRow], torch.Tensor,
                                                                   dict[str, float]]:
        """This step's batch from the queue of batches generated ahead (hpcrl.trainer.ahead). A start
        or resume first generates what the queue lacks (nothing past trainer.total_steps), a saved
        batch staler than rollout.max_staleness is regenerated; then the batch rollout.max_staleness
        steps ahead starts generating, to be collected by `collect_ahead` after this step's update."""
        def start(at: int, indices: list[int] | None) -> Callable[[], Generated]:
            return self._start_rollout(at, step - 1, indices)

        def now(generate: Callable[[], Generated]) -> Generated:  # what this step waits for before training
            with timer("generate"):
                return generate()

        # the queue holds the batches of steps step, step + 1, ...
        item = self.ahead.next_batch(step, int(self.cfg.trainer.total_steps), start, now)
        batch = item.batch
        batch["policy_version"] = torch.full((len(batch),), item.version, dtype=torch.long)
        metrics = {**item.metrics, "rollout/policy_version": float(item.version),
                   "rollout/staleness": float(step - 1 - item.version),
                   "data/prompt_rows": [int(i) for i in item.indices], "data/sampling_seeds": [self._seed(step, 0)]}
        return batch, [self.train_data[i] for i in item.indices], item.scores, metrics

    def collect_ahead(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """After the update: wait for the batch generated meanwhile, then send the new weights."""
        if self.ahead.in_flight is None:
            return {}
        with timer("generate_wait"):  # what the update did not hide of the generation
            self.ahead.queue.append(self.ahead.in_flight())
            self.ahead.in_flight = None
        with timer(self.placement.sync_phase):
            return self.placement.to_rollout(step)

    def rollout_stream(self, step: int, timer: PhaseTimer) -> tuple[Batch, list[PromptRow], torch.Tensor,
                                                                    dict[str, float]]:
        """This step's batch from the fully asynchronous stream (hpcrl.trainer.stream): the first
        data.train_batch_size finished groups, generated meanwhile; the trainer waits (time/generate)
        only when fewer are ready."""
        from hpcrl.trainer.stream import batch_of

        with timer("batch_wait"):  # the trainer idle until enough groups have finished
            groups = self.stream.next_batch(step - 1)
        batch, metrics = batch_of(groups, step - 1)
        rows = [self.train_data[g.row] for g in groups]
        with timer("reward"):
            scores, reward_metrics = self.score(Sampled(batch), rows, self.cfg.rollout.n,
                                                self.cfg.rollout.max_new_tokens)
        return batch, rows, scores, {**reward_metrics, **metrics, "data/prompt_rows": [g.row for g in groups]}

    def collect_stream(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """After the update: the segment in flight finishes, the new weights go to the engines."""
        with timer("generate_wait"):
            self.stream.settle()
        with timer(self.placement.sync_phase):
            metrics = self.placement.to_rollout(step)
        self.stream.stream.new_weights(step)
        return {**metrics, **self.stream.step_metrics()}

    def save_controller_files(self, folder: Path) -> list[dict[str, Any]]:
        """The batches generated ahead or the stream, into a checkpoint folder (records for its manifest)."""
        if self.stream is not None:
            return self.stream.save(folder)
        return self.ahead.save(folder) if self.ahead.queue else []

    def controller_files_nbytes(self) -> int:
        """Bytes `save_controller_files` writes (the checkpoint's disk-space check counts them)."""
        return self.stream.nbytes() if self.stream is not None else self.ahead.nbytes()

    def load_controller_files(self, folder: Path) -> None:
        if self.stream is not None:
            self.stream.load(folder)
            return
        self.ahead.load(folder)
        if self.ahead.queue:
            log.info("resumed with %d batch(es) generated ahead, for step(s) %s", len(self.ahead.queue),
                     [g.step for g in self.ahead.queue])

    # the step ----------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        cfg, algo = self.cfg, self.algo
        timer = PhaseTimer()
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        with timer(self.placement.sync_phase):  # the weights after step - 1 into the engines
            metrics.update(self.placement.to_rollout(step - 1))
        if self.val_data is not None and (step - 1) % cfg.trainer.val_every == 0:
            with timer("validate"):
                metrics.update(self.validate())
        if self.stream is not None:
            batch, rows, scores, reward_metrics = self.rollout_stream(step, timer)
        elif self.ahead.depth or self.ahead.queue:
            batch, rows, scores, reward_metrics = self.rollout_ahead(step, timer)
        else:
            batch, rows, scores, reward_metrics = self.rollout(step, timer)
        metrics.update(reward_metrics)
        mask = batch["response_mask"]
        lengths = mask.sum(-1)
        if algo.overlong_buffer > 0:
            penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, algo.overlong_buffer,
                                       algo.overlong_penalty)
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
            scores = scores + penalty
        baseline = None
        if algo.adv_estimator == "remax":
            with timer("generate"):
                greedy = SamplingSettings.from_rollout_config(self.plain["rollout"], n=1, temperature=0.0)
                gb = self.sample([row.prompt_ids for row in rows], greedy)
                base, _ = self.score(gb, rows, 1, cfg.rollout.max_new_tokens)
            baseline = base.repeat_interleave(cfg.rollout.n)
            metrics["reward/greedy_baseline_mean"] = float(base.mean())
        with timer("to_training"):
            self.placement.to_training()

        old_source = self._old_logprob_source(len(batch))
        if old_source == "recompute":
            with timer("old_logprob"):
                batch["old_logprob"] = self.actor.compute_logprob(batch, response_only=True)
            metrics.update(logprob_gap(batch["rollout_logprob"], batch["old_logprob"], mask, step))
            if "token_version" in batch.keys():  # the stream's tokens, by the weights that made them
                from hpcrl.trainer.stream import gap_by_version

                metrics.update(gap_by_version(batch, step - 1))
        elif old_source == "rollout":
            batch["old_logprob"] = batch["rollout_logprob"].clone()
        if algo.rollout_correction != "none":  # the decoupled objective's behaviour weights (tis | mis)
            batch["is_weight"], is_metrics = truncated_is_weights(batch["old_logprob"], batch["rollout_logprob"],
                                                                  mask, algo.rollout_is_cap, algo.rollout_correction)
            metrics.update(is_metrics)
        # "current" (on-policy): no old_logprob field, the update uses its own forward's, detached
        if self.reference is not None:
            with timer("ref_logprob"):
                batch["ref_logprob"] = self.reference.compute_logprob(batch, response_only=True)
        if self.critic is not None:
            with timer("values"):
                batch["old_values"] = self.critic.compute_values(batch)

        kl = None
        if self.reference is not None and algo.use_kl_in_reward:  # (the KL loss is the actor's own)
            kl = kl_estimate(batch["old_logprob"], batch["ref_logprob"], algo.kl_penalty) * mask
            metrics["actor/kl"] = float(masked_mean(kl, mask))
        kl_coef = self.kl_ctrl.value
        token_rewards = token_level_rewards(scores, mask, kl if algo.use_kl_in_reward else None,
                                            kl_coef if algo.use_kl_in_reward else 0.0)
        advantages, returns = compute_advantages(
            algo.adv_estimator, scores=scores, group=batch["prompt_index"], mask=mask, token_rewards=token_rewards,
            values=batch["old_values"] if self.critic is not None else None, baseline_scores=baseline,
            gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_adv_by_std)
        batch["advantages"] = advantages.float()
        if algo.use_kl_in_reward:
            metrics["actor/kl_coef"] = kl_coef
            # the horizon of the adaptive controller (Ziegler et al.) is counted in samples
            self.kl_ctrl.update(metrics["actor/kl"], n_steps=len(batch))

        samples = len(batch)
        if self.critic is not None:
            batch["returns"] = returns.float()
            c = cfg.critic
            n_mb = samples // c.ppo_mini_batch_size
            with timer("update_critic"):
                arranged = arrange_minibatches(batch, n_mb, self.dp_size, "token-mean",
                                               shuffle_seed=self._shuffle_seed(step, "critic"))
                out = self.critic.update_critic(arranged, num_minibatches=n_mb, epochs=c.ppo_epochs)
            metrics.update({f"critic/{k}": v for k, v in out.items()})
            metrics["critic/values_mean"] = float(masked_mean(batch["old_values"], mask))
            metrics["critic/returns_mean"] = float(masked_mean(returns, mask))
        a = cfg.actor
        n_mb = samples // a.ppo_mini_batch_size
        with timer("update_actor"):
            arranged = arrange_minibatches(batch, n_mb, self.dp_size, a.loss_agg_mode,
                                           shuffle_seed=self._shuffle_seed(step, "actor"),
                                           group_key="prompt_index" if a.minibatch_by == "prompt" else None)
            if old_source == "recompute":  # the gap was measured by the separate forward
                arranged.tensors.pop("rollout_logprob")
            out = self.actor.update_actor(arranged, num_minibatches=n_mb, epochs=a.ppo_epochs)
        if "logprob_gap_tokens" in out:  # measured in the update's first forward
            tokens, total, top = out.pop("logprob_gap_tokens"), out.pop("logprob_gap_sum"), out.pop("logprob_gap_max")
            metrics.update({"rollout_actor_logprob_gap_mean": total / max(tokens, 1.0),
                            "rollout_actor_logprob_gap_max": top})
        metrics.update({f"actor/{k}": v for k, v in out.items()})
        metrics.update(self.collect_ahead(step, timer) if self.stream is None else self.collect_stream(step, timer))
        # the engines that generated for the step (a fully_async stream counts its rollout pools' too)
        metrics.setdefault("rollout/workers", float(len(self.placement.rollout.ranks)))

        # every worker process hosts an actor rank or a rollout engine (the other roles live with the actor)
        metrics.update(peak_memory_metrics(*self.placement.peak_memory()))
        # the step's timeline (tools/bench_async.py draws it): the controller's phases, and with the
        # split placement when the engines generated (also while the trainer updated)
        metrics["trace/controller"] = timer.spans
        if self.placement.rollout is not self.actor:
            metrics["trace/rollout"] = self.placement.rollout.generation_spans()
        step_s = time.perf_counter() - t0
        resp_tokens = float(lengths.sum())
        all_tokens = float(batch["attention_mask"].sum())
        metrics.update({
            "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if samples > 1 else 0.0,
            **distribution_metrics("advantages", advantages, mask),
            **per_source_metrics("reward_by_source", scores,  # row r answers prompt rows[r // n]
                                 [row.data_source for row in rows for _ in range(cfg.rollout.n)]),
            "response_length/mean": float(lengths.float().mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float((lengths >= cfg.rollout.max_new_tokens).float().mean()),
            "prompt_length/mean": float((batch["attention_mask"].sum(-1) - lengths).float().mean()),
            "data/epoch": float(self.sampler.state_dict()["epoch"]),
            "time/step": step_s, "throughput/tokens_per_s": all_tokens / step_s,
            "throughput/response_tokens_per_s": resp_tokens / step_s,
            # (not when the generation ran during the last step, hidden by its update)
            **({"throughput/rollout_tokens_per_s": resp_tokens / max(timer.seconds["generate"], 1e-9)}
               if "generate" in timer.seconds else {}),
            **{f"time/{k}": v for k, v in timer.seconds.items()},
            # tokens each phase processed: generated ones, then every token once per forward and epoch
            **phase_throughput(timer.seconds, {
                "generate": resp_tokens, "old_logprob": all_tokens, "ref_logprob": all_tokens, "values": all_tokens,
                "update_actor": all_tokens * a.ppo_epochs, "update_critic": all_tokens * cfg.critic.ppo_epochs}),
        })
        return metrics

    # validation --------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Greedy answers on the validation prompts (weights must be in the rollout engines):
        accuracy and mean reward, also per data source."""
        assert self.val_data is not None
        cfg = self.cfg
        greedy = SamplingSettings.from_rollout_config(self.plain["rollout"], n=1, temperature=0.0)
        limit = cfg.data.val_max_samples or len(self.val_data)
        scores, accs, sources = [], [], []
        for idx in iterate_batches(range(min(limit, len(self.val_data))), cfg.data.val_batch_size):
            rows = [self.val_data[i] for i in idx]
            s, m = self.score(self.sample([row.prompt_ids for row in rows], greedy), rows, 1,
                              cfg.rollout.max_new_tokens)
            advance(len(rows), work=min(limit, len(self.val_data)), unit="prompts")  # progress lines
            scores.append(s)
            accs.append(m.get("reward/acc", float("nan")) * len(rows))
            sources += [row.data_source for row in rows]
        all_scores = torch.cat(scores)
        out = {"val/reward_mean": float(all_scores.mean()), "val/samples": float(len(all_scores))}
        if all(a == a for a in accs):  # no NaN: the scorer reported accuracy
            out["val/acc"] = sum(accs) / len(all_scores)
        log.info("validation after %d step(s): %s", self.step,
                 ", ".join(f"{k} {v:.4f}" for k, v in out.items()))
        return out

    def final_validation(self) -> dict[str, float]:
        """The validation after the last step (the weights go into the rollout engines first)."""
        self.placement.to_rollout(self.step)
        return self.validate()

    def close(self) -> None:
        if getattr(self.placement, "pools", None) is not None:
            self.placement.pools.close()
        self.scorer.close()
        if self.agent is not None:
            self.agent.close()
        self.placement.close()
