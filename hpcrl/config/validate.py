"""Cross-field checks that types alone cannot express: enum values, ranges, the parallel layout
arithmetic, the model's shape against that layout, and the paths a run reads.

All problems are collected, not just the first, so one edit fixes a config.
"""

from __future__ import annotations

import math
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hpcrl.config.derived import (
    critic_enabled,
    is_dpo,
    is_split,
    kl_loss_active,
    reference_enabled,
    role_parallel,
    rollout_mode,
    rollout_world_size,
    token_multiple,
    trainer_world_size,
    world_size,
)
from hpcrl.config.engines import engine_problems
from hpcrl.config.loader import ConfigError

ROLLOUT_MODES = ("sync", "one_step_off", "fully_async")
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("auto", "fp32", "bf16"),
    "model.local_attention": ("per_sequence", "dense"),
    "actor.optim.lr_schedule": ("constant", "cosine", "linear"),
    "critic.optim.lr_schedule": ("constant", "cosine", "linear"),
    "actor.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "actor.kl_loss_type": ("k1", "k2", "k3"),
    "actor.old_logprob": ("auto", "recompute", "rollout"),
    "actor.minibatch_by": ("prompt", "sample"),
    "algorithm.name": ("ppo", "dpo"),
    "algorithm.dpo.loss_type": ("sigmoid", "ipo"),
    "algorithm.adv_estimator": ("gae", "grpo", "rloo", "reinforce_plus_plus",
                                "reinforce_plus_plus_baseline", "remax"),
    "algorithm.policy_loss": ("ppo_clip", "dual_clip", "clip_higher"),
    "algorithm.kl_penalty": ("k1", "k2", "k3"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    "logging.wandb.mode": ("disabled", "offline", "online"),
    "slurm.mpi": ("pmi2", "pmix"),
    "checkpoint.on_save_error": ("stop", "continue"),
    "trainer.placement": ("colocated", "split"),
    "algorithm.rollout_correction": ("none", "tis", "mis"),
    "actor.recompute": ("none", "selective", "full"),
    "critic.recompute": ("none", "selective", "full"),
    "actor.engine": ("megatron", "fsdp"),
    "critic.engine": (None, "megatron", "fsdp"),
    "reference.engine": (None, "megatron", "fsdp"),
}

# key -> (lowest allowed, highest allowed, inclusive low); None = unbounded
RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "actor.parallel.tensor_parallel": (1, None, True),
    "actor.parallel.pipeline_parallel": (1, None, True),
    "actor.parallel.context_parallel": (1, None, True),
    "critic.parallel.tensor_parallel": (1, None, True),
    "critic.parallel.pipeline_parallel": (1, None, True),
    "critic.parallel.context_parallel": (1, None, True),
    "reference.parallel.tensor_parallel": (1, None, True),
    "reference.parallel.pipeline_parallel": (1, None, True),
    "reference.parallel.context_parallel": (1, None, True),
    "actor.parallel.expert_parallel": (1, None, True),
    "critic.parallel.expert_parallel": (1, None, True),
    "reference.parallel.expert_parallel": (1, None, True),
    # a negative weight would reward unbalanced routing (aux) or large router logits (z)
    "actor.moe.aux_loss_coeff": (0, None, True),
    "actor.moe.z_loss_coeff": (0, None, True),
    "critic.moe.aux_loss_coeff": (0, None, True),
    "critic.moe.z_loss_coeff": (0, None, True),
    "rollout.tensor_parallel": (1, None, True),
    "actor.lora.rank": (0, None, True),
    "actor.lora.alpha": (0, None, False),
    "actor.lora.dropout": (0, 1, True),
    "rollout.n": (1, None, True),
    # > 0: the trainer's log-probs are those of softmax(logits / T) (greedy is for validation only)
    "rollout.temperature": (0, None, False),
    "rollout.top_p": (0, 1, False),
    "rollout.max_new_tokens": (1, None, True),
    "rollout.min_new_tokens": (0, None, True),
    "rollout.gpu_memory_utilization": (0, 1, False),
    "rollout.cpu_kv_cache_gib": (0, None, False),
    "rollout.weight_bucket_mb": (1, None, True),
    "rollout.multi_turn.max_turns": (1, None, True),
    "rollout.multi_turn.max_total_tokens": (1, None, True),
    "rollout.multi_turn.max_tool_calls_per_turn": (1, None, True),
    "rollout.multi_turn.tool_timeout_s": (0, None, False),
    "rollout.multi_turn.max_tool_result_chars": (1, None, True),
    "actor.ppo_mini_batch_size": (1, None, True),
    "actor.ppo_epochs": (1, None, True),
    "actor.micro_batch_tokens": (1, None, True),
    "actor.micro_batch_size": (1, None, True),
    "critic.micro_batch_size": (1, None, True),
    "actor.clip_ratio_low": (0, 1, False),
    "actor.clip_ratio_high": (0, None, False),
    "actor.clip_ratio_c": (1, None, False),
    "actor.optim.lr": (0, None, True),
    "actor.optim.min_lr": (0, None, True),
    "actor.optim.warmup_steps": (0, None, True),
    "actor.optim.weight_decay": (0, None, True),
    "actor.optim.adam_eps": (0, None, False),
    "actor.optim.clip_grad": (0, None, True),  # 0: no clipping
    "critic.optim.lr": (0, None, True),
    "critic.optim.clip_grad": (0, None, True),
    # a negative coefficient would reward moving away from the reference
    "actor.kl_loss_coef": (0, None, True),
    "algorithm.kl_ctrl.kl_coef": (0, None, True),
    "algorithm.kl_ctrl.target_kl": (0, None, False),
    "algorithm.kl_ctrl.horizon": (1, None, True),
    "critic.ppo_mini_batch_size": (1, None, True),
    "critic.ppo_epochs": (1, None, True),
    "critic.micro_batch_tokens": (1, None, True),
    "algorithm.gamma": (0, 1, True),
    "algorithm.lam": (0, 1, True),
    "reward.timeout_s": (0, None, False),
    # beta scales the implicit rewards; DPO's loss has no preference direction at 0 and flips below it
    "algorithm.dpo.beta": (0, None, False),
    "algorithm.dpo.label_smoothing": (0, 0.5, True),  # 0.5 itself is refused in _check_dpo
    "data.max_response_length": (1, None, True),
    "data.max_prompt_length": (1, None, True),
    "data.train_batch_size": (1, None, True),
    "data.val_batch_size": (1, None, True),
    "data.val_max_samples": (0, None, True),
    "data.max_skipped_row_share": (0, 1, True),
    "trainer.total_steps": (0, None, True),
    "trainer.val_every": (0, None, True),
    "trainer.nnodes": (1, None, True),
    "trainer.workers_per_node": (1, None, True),
    "trainer.timeout_s": (1, None, True),
    "trainer.max_nonfinite_steps": (0, None, True),
    "trainer.rollout_workers": (0, None, True),
    "rollout.max_staleness": (0, None, True),
    "rollout.segment_tokens": (1, None, True),
    "rollout.pool_liveness_s": (1, None, True),
    "algorithm.rollout_is_cap": (1, None, True),
    "checkpoint.save_every": (0, None, True),
    "logging.log_every": (1, None, True),
    "logging.progress_after_s": (0, None, True),
    "logging.progress_every_s": (0, None, True),
    "checkpoint.keep_last": (1, None, True),
    "checkpoint.keep_every": (0, None, True),
    "slurm.gpus_per_node": (0, None, True),
    "slurm.cpus_per_worker": (1, None, True),
    "slurm.signal_before_s": (0, None, True),
    "slurm.max_failure_requeues": (0, None, True),
}

_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")
ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def dotted_value(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if node is None:  # an optional section left null (e.g. critic.parallel: the actor's)
            return None
        node = node[part]
    return node


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _non_finite(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value is a NaN or infinite float (every range check passes NaN)."""
    if isinstance(node, DictConfig):
        return [k for key in node if not OmegaConf.is_missing(node, key)
                for k in _non_finite(node[key], f"{prefix}{key}.")]
    if isinstance(node, float) and not math.isfinite(node):
        return [prefix.rstrip(".")]
    return []


def _check_choices_and_ranges(cfg: DictConfig, problems: list[str]) -> None:
    for key in _non_finite(cfg):
        problems.append(f"{key}={dotted_value(cfg, key)}: must be a finite number.")
    mode = cfg.rollout.mode
    if mode is not None and mode not in ROLLOUT_MODES:
        problems.append(f"rollout.mode={mode!r}: not one of {', '.join(ROLLOUT_MODES)} (or null).")
    for key, allowed in CHOICES.items():
        value = dotted_value(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r}: not one of {', '.join(allowed)}.")
    for key, (lo, hi, lo_inclusive) in RANGES.items():
        value = dotted_value(cfg, key)
        if value is None:
            continue
        too_low = lo is not None and (value < lo if lo_inclusive else value <= lo)
        too_high = hi is not None and value > hi
        if too_low or too_high:
            lo_s = "" if lo is None else f"{'>=' if lo_inclusive else '>'} {lo}"
            hi_s = "" if hi is None else f"<= {hi}"
            problems.append(f"{key}={value}: must be {' and '.join(s for s in (lo_s, hi_s) if s)}.")
    for role in ("actor", "critic"):
        for beta in ("adam_beta1", "adam_beta2"):
            value = dotted_value(cfg, f"{role}.optim.{beta}")
            if not 0 <= value < 1:
                problems.append(f"{role}.optim.{beta}={value}: must be >= 0 and < 1 (Adam's moment decay).")
    top_k = cfg.rollout.top_k
    if top_k != -1 and top_k < 1:
        problems.append(f"rollout.top_k={top_k}: must be -1 (off) or >= 1.")
    r = cfg.rollout
    if r.min_new_tokens > r.max_new_tokens >= 1:
        problems.append(f"rollout.min_new_tokens={r.min_new_tokens}: must be <= rollout.max_new_tokens="
                        f"{r.max_new_tokens} (a response cannot be longer than the longest).")
    if not _SLURM_TIME.match(str(cfg.slurm.time)):
        problems.append(f"slurm.time={cfg.slurm.time!r}: not a Slurm time. Use MM, HH:MM:SS or D-HH:MM:SS.")
    if cfg.reward.function != "builtin" and not ENTRY_POINT.match(cfg.reward.function):
        problems.append(f"reward.function={cfg.reward.function!r}: use 'builtin' or 'package.module:function'.")
    lora = cfg.actor.lora
    if lora.rank:  # (the targets are checked against the engine's layers by the preflight)
        if lora.dropout >= 1:
            problems.append(f"actor.lora.dropout={lora.dropout}: must be < 1.")
    elif lora.adapters:
        problems.append(f"actor.lora.adapters={lora.adapters!r} without actor.lora.rank: set the adapters' rank "
                        "(and alpha) to train with LoRA.")
    ck = cfg.checkpoint
    if ck.keep_every and ck.save_every and ck.keep_every % ck.save_every:
        problems.append(f"checkpoint.keep_every={ck.keep_every}: must be a multiple of "
                        f"checkpoint.save_every={ck.save_every}, or no checkpoint is ever kept.")


def _check_layout(cfg: DictConfig, problems: list[str]) -> None:
    if world_size(cfg) < 1:
        return  # trainer.nnodes / trainer.workers_per_node < 1: reported by the range check
    _check_rollout_correction(cfg, problems)
    if not _check_placement(cfg, problems):
        return
    w = trainer_world_size(cfg)
    where = (f"the {w} workers (trainer.nnodes={cfg.trainer.nnodes} x "
             f"trainer.workers_per_node={cfg.trainer.workers_per_node})")
    if is_split(cfg):
        where = (f"the {w} trainer workers ({world_size(cfg)} workers, trainer.rollout_workers="
                 f"{cfg.trainer.rollout_workers} of them for the rollout)")
    roles = {"actor": cfg.actor.parallel}
    if critic_enabled(cfg) and cfg.critic.parallel is not None:
        roles["critic"] = cfg.critic.parallel
    if reference_enabled(cfg) and cfg.reference.parallel is not None:
        roles["reference"] = cfg.reference.parallel
    for role, p in roles.items():
        tp, pp, cp = p.tensor_parallel, p.pipeline_parallel, p.context_parallel
        if tp < 1 or pp < 1 or cp < 1:
            continue  # reported by the range check
        if p.sequence_parallel and tp == 1:
            problems.append(
                f"{role}.parallel.sequence_parallel=true: needs {role}.parallel.tensor_parallel > 1 (sequence "
                "parallel splits the norm regions over the TP ranks; with one TP rank there is nothing to split). "
                f"Set {role}.parallel.tensor_parallel >= 2 or sequence_parallel=false.")
        if w % (tp * pp):
            problems.append(
                f"{role}.parallel.tensor_parallel={tp}, {role}.parallel.pipeline_parallel={pp}: "
                f"TP x PP = {tp * pp} does not divide {where}; world size {w} needs TP x PP in "
                f"{{{_divisors(w)}}}.")
        elif w % (tp * pp * cp):
            # the world is TP x PP x CP x DP; name the CPs that this TP x PP leaves room for
            problems.append(
                f"{role}.parallel.context_parallel={cp}: with {role}.parallel.tensor_parallel={tp} and "
                f"{role}.parallel.pipeline_parallel={pp}, TP x PP x CP = {tp * pp * cp} does not divide {where}; "
                f"world size {w} needs TP x PP x CP in {{{_divisors(w)}}}: context_parallel in "
                f"{{{_divisors(w // (tp * pp))}}}.")
        elif p.data_parallel is not None and p.data_parallel * tp * pp * cp != w:
            sizes, names = (f"{tp}x{pp}x{cp}x{p.data_parallel}", "TP x PP x CP x DP") if cp > 1 else \
                (f"{tp}x{pp}x{p.data_parallel}", "TP x PP x DP")
            problems.append(
                f"{role}.parallel.data_parallel={p.data_parallel}: {names} = {sizes} "
                f"= {tp * pp * cp * p.data_parallel}, but world size is {w} ({where}). "
                f"Use {w // (tp * pp * cp)} or leave it null.")
    _check_long_sequences(cfg, problems)
    rtp, rw = cfg.rollout.tensor_parallel, rollout_world_size(cfg)
    if rtp >= 1 and rw % rtp:
        on = f"the {rw} rollout workers (trainer.rollout_workers)" if is_split(cfg) else where
        size = "the rollout's world size" if is_split(cfg) else "world size"
        problems.append(f"rollout.tensor_parallel={rtp}: does not divide {on}; {size} {rw} needs "
                        f"a rollout TP in {{{_divisors(rw)}}}.")
    # megatron's process groups are per process, and the roles are colocated on the same ranks
    shared = {"critic": cfg.critic.parallel if critic_enabled(cfg) else None, "reference": cfg.reference.parallel}
    # (sequence parallel may differ: it changes how a role's own layers communicate, not the groups)
    a = cfg.actor.parallel

    def shown(q: Any, with_cp: bool, with_ep: bool) -> str:
        return (f"TP={q.tensor_parallel} PP={q.pipeline_parallel}" + (f" CP={q.context_parallel}" if with_cp else "")
                + (f" EP={q.expert_parallel}" if with_ep else ""))

    for role, p in shared.items():
        if p is None:
            continue
        mine, actor = ((q.tensor_parallel, q.pipeline_parallel, q.context_parallel, q.expert_parallel) for q in (p, a))
        if mine != actor:
            with_cp = p.context_parallel != 1 or a.context_parallel != 1
            with_ep = p.expert_parallel != 1 or a.expert_parallel != 1
            problems.append(f"{role}.parallel: {shown(p, with_cp, with_ep)} differs from actor.parallel "
                            f"({shown(a, with_cp, with_ep)}); "
                            "colocated Megatron roles share one layout. Set both alike (or leave "
                            f"{role}.parallel null).")
    if is_dpo(cfg):
        _check_dpo(cfg, problems)
        return
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is False:
        problems.append("critic.enable=false: algorithm.adv_estimator=gae needs a critic. "
                        "Enable it or pick grpo/rloo/reinforce_plus_plus/remax.")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and cfg.rollout.n < 2:
        problems.append(f"rollout.n={cfg.rollout.n}: {cfg.algorithm.adv_estimator} compares samples of one "
                        "prompt and needs rollout.n >= 2.")

    samples = cfg.data.train_batch_size * cfg.rollout.n
    for role in ("actor", "critic") if critic_enabled(cfg) else ("actor",):
        mb = dotted_value(cfg, f"{role}.ppo_mini_batch_size")
        if mb >= 1 and samples % mb:
            problems.append(f"{role}.ppo_mini_batch_size={mb}: must divide the {samples} samples of a step "
                            f"(data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n}).")
    model_parallel = _model_parallel_size(cfg.actor.parallel)
    mb = cfg.actor.ppo_mini_batch_size
    if model_parallel >= 1 and w % model_parallel == 0 and mb >= 1 and mb % (w // model_parallel):
        problems.append(f"actor.ppo_mini_batch_size={mb}: must be a multiple of the actor's data-parallel "
                        f"size {w // model_parallel}, so every DP rank gets the same number of samples.")


def _model_parallel_size(p: Any) -> int:
    """TP x PP x CP of a `parallel` section: the ranks one data-parallel replica spans (0 when a
    size is out of range, which the range check reports)."""
    sizes = (p.tensor_parallel, p.pipeline_parallel, p.context_parallel)
    return 0 if min(sizes) < 1 else math.prod(sizes)


def _check_long_sequences(cfg: DictConfig, problems: list[str]) -> None:
    """Context and sequence parallel against the keys they constrain: the attention they need, the
    packing budget they cut, the LoRA layers they cannot feed."""
    roles = ["actor"] + (["critic"] if critic_enabled(cfg) else [])
    for role in roles:
        p = role_parallel(cfg, role)
        if min(p.tensor_parallel, p.context_parallel) < 1:
            continue  # reported by the range check
        where = f"{role}.parallel" if role == "actor" or cfg[role].parallel is not None else "actor.parallel"
        section = cfg[role]
        multiple = token_multiple(p.tensor_parallel, p.context_parallel, bool(p.sequence_parallel))
        budget = section.micro_batch_tokens
        # the engine pads every packed row up to the multiple: a budget off it would be overrun
        if section.packing and multiple > 1 and budget >= 1 and budget % multiple:
            why = [f"{where}.context_parallel={p.context_parallel}: 2 x CP chunks a sequence"] \
                if p.context_parallel > 1 else []
            if p.sequence_parallel:
                why.append(f"{where}.sequence_parallel=true: each rank's part is cut over "
                           f"{where}.tensor_parallel={p.tensor_parallel}")
            below, above = budget // multiple * multiple, -(-budget // multiple) * multiple
            nearest = f"{below} or {above}" if below else f"{above}"
            problems.append(f"{role}.micro_batch_tokens={budget}: must be a multiple of {multiple} ({'; '.join(why)}), "
                            f"the length every packed row is padded to a multiple of. Use {nearest}.")
    a = cfg.actor.parallel
    if a.context_parallel > 1 and cfg.model.local_attention == "dense":
        problems.append(f"model.local_attention=dense: not with actor.parallel.context_parallel={a.context_parallel}; "
                        "the dense attention's block mask covers whole packed rows, and a CP rank holds only chunks "
                        "of each sequence. Use model.local_attention=per_sequence (or context_parallel=1).")
    if a.sequence_parallel and cfg.actor.lora.rank:
        # the engine refuses it when it builds the model (hpcrl.engines.megatron.engine), after start-up
        problems.append("actor.parallel.sequence_parallel=true: not with LoRA (actor.lora.rank="
                        f"{cfg.actor.lora.rank}); the adapters' layers do not take sequence-parallel input. Set "
                        "actor.parallel.sequence_parallel=false for LoRA runs.")


def _check_placement(cfg: DictConfig, problems: list[str]) -> bool:
    """Split placement and asynchronous rollout; False when the worker counts make the layout checks
    meaningless."""
    t, staleness = cfg.trainer, cfg.rollout.max_staleness
    _check_rollout_mode(cfg, problems)
    if not is_split(cfg):
        if t.rollout_workers:
            problems.append(f"trainer.rollout_workers={t.rollout_workers}: only for trainer.placement=split (the "
                            "colocated placement runs an engine on every worker). Set the placement or remove it.")
        if staleness and cfg.rollout.mode is None:
            problems.append(f"rollout.max_staleness={staleness}: generation can only run ahead of training when the "
                            "engines have workers of their own; set trainer.placement=split and "
                            "trainer.rollout_workers, or leave it null.")
        return True
    w = world_size(cfg)
    if not 1 <= t.rollout_workers < w:
        problems.append(f"trainer.rollout_workers={t.rollout_workers}: trainer.placement=split needs 1 to {w - 1} of "
                        f"the {w} workers for the rollout engines (the others train).")
        return False
    if is_dpo(cfg):
        problems.append("trainer.placement=split: algorithm.name=dpo has no rollout; use the colocated placement.")
    mode = rollout_mode(cfg)
    if mode != "sync":
        # these make several generation rounds per step, each depending on the last one's results
        for key, on, why in (("algorithm.dynamic_sampling", cfg.algorithm.dynamic_sampling,
                              "refills a batch from what its rewards were"),
                             ("algorithm.adv_estimator", cfg.algorithm.adv_estimator == "remax",
                              "remax generates a greedy baseline with the current weights"),
                             ("rollout.multi_turn.enable", cfg.rollout.multi_turn.enable,
                              "the multi-turn loop drives the engines turn by turn")):
            if on:
                problems.append(f"{key}={dotted_value(cfg, key)}: not with generation ahead of training "
                                f"(rollout.mode={mode}): it {why}. Set rollout.mode=sync to use it with the "
                                "split placement.")
    return True


def _check_rollout_mode(cfg: DictConfig, problems: list[str]) -> None:
    """rollout.mode against the placement and rollout.max_staleness / partial_rollout (rollout_mode
    derives the mode when it is null)."""
    r = cfg.rollout
    mode, staleness = r.mode, r.max_staleness
    if mode in ("one_step_off", "fully_async") and not is_split(cfg):
        problems.append(f"rollout.mode={mode}: generation can only run beside training when the engines have "
                        "workers of their own; set trainer.placement=split and trainer.rollout_workers, or use "
                        "rollout.mode=sync.")
    if mode == "sync" and staleness:
        problems.append(f"rollout.max_staleness={staleness}: rollout.mode=sync generates each step's batch with the "
                        "current weights; set it to 0 or null, or use rollout.mode=one_step_off.")
    if mode == "one_step_off" and staleness == 0:
        problems.append("rollout.max_staleness=0: rollout.mode=one_step_off generates at least 1 step ahead; set it "
                        "to 1 or more (null: 1), or use rollout.mode=sync.")
    if r.partial_rollout is not None and rollout_mode(cfg) != "fully_async":
        problems.append(f"rollout.partial_rollout={r.partial_rollout}: only with rollout.mode=fully_async (samples "
                        "in flight across a weight update); remove it or set the mode.")
    if mode != "fully_async":
        return
    if staleness == 0:
        problems.append("rollout.max_staleness=0: rollout.mode=fully_async trains tokens made while the trainer "
                        "updated, a version behind at least; set it to 1 or more (null: 1), or use rollout.mode=sync.")
    for key, on, why in (("rollout.routing_replay", r.routing_replay, "the experts of a sample's segments are not "
                          "joined yet"),
                         ("rollout.stop", bool(r.stop), "a stop string across two segments would not be seen"),
                         ("rollout.min_new_tokens", r.min_new_tokens > 0, "each segment would count it again")):
        if on:
            problems.append(f"{key}={dotted_value(cfg, key)}: not with rollout.mode=fully_async yet: {why}. Use "
                            "rollout.mode=one_step_off.")


def _check_rl_switches(cfg: DictConfig, problems: list[str]) -> None:
    """Switches of the RL loop that contradict each other (DPO has its own, `_check_dpo`)."""
    if is_dpo(cfg):
        return
    a, algo = cfg.actor, cfg.algorithm
    if cfg.reference.enable is False:
        # the KL terms are to the reference's log-probs: without it the step would fail after generating
        if algo.use_kl_in_reward:
            problems.append("reference.enable=false: algorithm.use_kl_in_reward=true needs the reference model (the "
                            "KL in the reward is to it). Leave reference.enable null (on when a KL term is used) or "
                            "set algorithm.use_kl_in_reward=false.")
        if kl_loss_active(cfg):
            problems.append(f"reference.enable=false: actor.use_kl_loss=true with actor.kl_loss_coef={a.kl_loss_coef} "
                            "needs the reference model (the KL loss is to it). Leave reference.enable null or set "
                            "actor.use_kl_loss=false.")
    if algo.policy_loss == "clip_higher" and a.clip_ratio_high <= a.clip_ratio_low:
        problems.append(f"actor.clip_ratio_high={a.clip_ratio_high}: algorithm.policy_loss=clip_higher (DAPO) needs it "
                        f"above actor.clip_ratio_low={a.clip_ratio_low}, or the clip is the symmetric PPO one and "
                        "clip-higher does nothing. Raise actor.clip_ratio_high (DAPO: 0.28 with 0.2) or use "
                        "algorithm.policy_loss=ppo_clip.")
    if a.lora.rank and a.lora.dropout > 0:
        problems.append(f"actor.lora.dropout={a.lora.dropout}: not in the RL loop. The old log-probs (and the "
                        "reference's) come from forwards without dropout and the update's forward drops adapter "
                        "inputs, so the PPO ratio of an unchanged policy is not 1 and the clip acts on noise. Set "
                        "it to 0 (algorithm.name=dpo may use it).")


def config_warnings(cfg: DictConfig) -> list[str]:
    """Settings that run but bias the update: printed by the `hpcrl` commands and logged by the run."""
    out: list[str] = []
    r, a = cfg.rollout, cfg.actor
    if is_dpo(cfg):
        return out
    cut = []
    if r.top_p < 1:
        cut.append(f"rollout.top_p={r.top_p}")
    if r.top_k > 0:
        cut.append(f"rollout.top_k={r.top_k}")
    if r.min_new_tokens > 0:  # vLLM masks the end-of-sequence token(s) until then: measured 1.7e-3 nats a
        cut.append(f"rollout.min_new_tokens={r.min_new_tokens}")  # token on the tiny model (p(EOS) ~ 1/512)
    uses = [k for k, on in (("actor.old_logprob=rollout", a.old_logprob == "rollout"),
                            (f"algorithm.rollout_correction={cfg.algorithm.rollout_correction}",
                             cfg.algorithm.rollout_correction != "none")) if on]
    if cut and uses:
        out.append(f"{' and '.join(cut)} with {' and '.join(uses)}: vLLM's log-probs are renormalised over the "
                   "tokens the cut keeps, the trainer's are over the whole vocabulary, so the ratio between them "
                   "is biased (above 1 on every kept token). Sample without the cut (rollout.top_p=1, "
                   "rollout.top_k=-1, rollout.min_new_tokens=0), or use actor.old_logprob=recompute without "
                   "algorithm.rollout_correction.")
    return out


def _check_rollout_correction(cfg: DictConfig, problems: list[str]) -> None:
    fix = cfg.algorithm.rollout_correction
    if fix != "none" and cfg.actor.old_logprob == "rollout":
        problems.append(f"algorithm.rollout_correction={fix}: with actor.old_logprob=rollout the old log-probs are the "
                        "rollout's own and every weight is 1. Use actor.old_logprob=auto or recompute.")


def _check_dpo(cfg: DictConfig, problems: list[str]) -> None:
    """What DPO needs of a config beyond ranges (the RL loop's batch arithmetic does not apply)."""
    d = cfg.algorithm.dpo
    if cfg.actor.parallel.context_parallel > 1:
        problems.append(f"actor.parallel.context_parallel={cfg.actor.parallel.context_parallel}: not with "
                        "algorithm.name=dpo; DPO's loss needs each response's whole log-prob sum on one rank, and "
                        "context parallel splits every sequence over its ranks. Use context_parallel=1.")
    if d.label_smoothing == 0.5:
        problems.append("algorithm.dpo.label_smoothing=0.5: must be < 0.5; at 0.5 both orders of a pair weigh the "
                        "same and the loss only pulls the margin to 0.")
    if d.label_smoothing and d.loss_type != "sigmoid":
        problems.append(f"algorithm.dpo.label_smoothing={d.label_smoothing}: conservative DPO's label smoothing is "
                        f"for algorithm.dpo.loss_type=sigmoid, not {d.loss_type}; set it to 0.")
    if cfg.reference.enable is False:
        problems.append("reference.enable=false: algorithm.name=dpo needs the reference model (its loss is "
                        "relative to it). Leave reference.enable null.")
    if cfg.critic.enable:
        problems.append("critic.enable=true: algorithm.name=dpo has no critic. Leave critic.enable null.")
    w = world_size(cfg)
    model_parallel = _model_parallel_size(cfg.actor.parallel)
    b = cfg.data.train_batch_size
    if model_parallel >= 1 and w % model_parallel == 0 and b >= 1 and b % (w // model_parallel):
        problems.append(f"data.train_batch_size={b}: must be a multiple of the actor's data-parallel size "
                        f"{w // model_parallel}: DPO gives every DP rank whole pairs, the same number each.")


def _check_multi_turn(cfg: DictConfig, problems: list[str]) -> None:
    """rollout.multi_turn: what the RL loop's other switches cannot do with conversations (the tools
    and the format against the registry: the preflight)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    if is_dpo(cfg):
        problems.append("rollout.multi_turn.enable=true: algorithm.name=dpo trains on fixed preference pairs and "
                        "generates nothing. Set it to false.")
        return
    if cfg.algorithm.overlong_buffer > 0:
        problems.append(f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer}: DAPO's overlong penalty is "
                        "measured against rollout.max_new_tokens, one turn; with rollout.multi_turn.enable=true set "
                        "it to 0 (the token budget is rollout.multi_turn.max_total_tokens).")


def _check_moe(cfg: DictConfig, problems: list[str]) -> None:
    """Expert parallel against each role's DP x CP, and routing replay against the loop (the model's
    experts: the preflight)."""
    w = trainer_world_size(cfg)
    roles = ["actor"] + [r for r in ("critic", "reference") if cfg[r].parallel is not None
                         and (critic_enabled(cfg) if r == "critic" else reference_enabled(cfg))]
    for role in roles:
        p = role_parallel(cfg, role)
        ep, model_parallel = p.expert_parallel, _model_parallel_size(p)
        if ep <= 1 or w < 1 or model_parallel < 1 or w % model_parallel:
            continue  # EP off, or the range and layout checks report it
        room = w // (p.tensor_parallel * p.pipeline_parallel)  # DP x CP
        if room % ep:
            problems.append(f"{role}.parallel.expert_parallel={ep}: does not divide the {role}'s DP x CP = {room} (the "
                            f"{w} trainer workers / TP={p.tensor_parallel} x PP={p.pipeline_parallel}); the EP ranks "
                            f"are carved out of the data- and context-parallel ranks. Use expert_parallel in "
                            f"{{{_divisors(room)}}}.")
    if not cfg.rollout.routing_replay:
        return
    if is_dpo(cfg):
        problems.append("rollout.routing_replay=true: algorithm.name=dpo has no rollout whose routing could be "
                        "replayed (it trains on fixed preference pairs). Set it to false.")
    if cfg.rollout.multi_turn.enable:
        problems.append("rollout.routing_replay=true: not with rollout.multi_turn.enable=true yet (the tool turns' "
                        "tokens are not routed by vLLM). Set one of them to false.")
    if cfg.actor.recompute != "none":
        problems.append(f"rollout.routing_replay=true: not with actor.recompute={cfg.actor.recompute} (the "
                        "recomputed forward would route again). Set actor.recompute=none.")


def value_problems(cfg: DictConfig) -> list[str]:
    """Every problem of the config's values: types, choices, ranges and the arithmetic between keys.
    Nothing here reads a file or knows an engine, a data set or a reward (hpcrl.trainer.preflight)."""
    return range_problems(cfg) + arithmetic_problems(cfg)


def range_problems(cfg: DictConfig) -> list[str]:
    """The problems of single values (finite numbers, choices, ranges): the same on any number of nodes."""
    problems: list[str] = []
    _check_choices_and_ranges(cfg, problems)
    return problems


def arithmetic_problems(cfg: DictConfig) -> list[str]:
    """The problems between keys: the layouts over the workers, the batch arithmetic, switches that exclude
    each other. What a search over node counts (hpcrl.plan.report) checks at each count."""
    problems: list[str] = []
    _check_layout(cfg, problems)
    _check_rl_switches(cfg, problems)
    _check_multi_turn(cfg, problems)
    _check_moe(cfg, problems)
    problems += engine_problems(cfg)
    return problems


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem of the config's values (`value_problems`). The checks
    that read files, models and data, and the registries of tools and rewards, are the preflight's
    (hpcrl.trainer.preflight), which every command runs before it starts anything."""
    problems = value_problems(cfg)
    if problems:
        raise ConfigError(problems)
