"""Cross-field checks that types alone cannot express: enum values, ranges, the parallel layout
arithmetic, the model's shape against that layout, and the paths a run reads.

All problems are collected, not just the first, so one edit fixes a config.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hpcrl.config.loader import ConfigError

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
    "algorithm.rollout_correction": ("none", "tis"),
}

# key -> (lowest allowed, highest allowed, inclusive low); None = unbounded
RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "actor.parallel.tensor_parallel": (1, None, True),
    "actor.parallel.pipeline_parallel": (1, None, True),
    "critic.parallel.tensor_parallel": (1, None, True),
    "critic.parallel.pipeline_parallel": (1, None, True),
    "rollout.tensor_parallel": (1, None, True),
    "actor.lora.rank": (0, None, True),
    "actor.lora.alpha": (0, None, False),
    "actor.lora.dropout": (0, 1, True),
    "rollout.n": (1, None, True),
    # > 0: the trainer's log-probs are those of softmax(logits / T) (greedy is for validation only)
    "rollout.temperature": (0, None, False),
    "rollout.top_p": (0, 1, False),
    "rollout.max_new_tokens": (1, None, True),
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
_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one role over the worker ranks."""

    tp: int
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"TP={self.tp} PP={self.pp} DP={self.dp}"


def world_size(cfg: DictConfig) -> int:
    """Number of worker ranks (the controller rank is not counted)."""
    return cfg.trainer.nnodes * cfg.trainer.workers_per_node


def is_split(cfg: Any) -> bool:
    """The rollout engines run on workers of their own (trainer.placement=split); cfg is the config
    or its plain-dict form."""
    return cfg["trainer"]["placement"] == "split"


def trainer_world_size(cfg: DictConfig) -> int:
    """Workers that hold the Megatron roles: all of them colocated, the first ones split."""
    return world_size(cfg) - (cfg.trainer.rollout_workers if is_split(cfg) else 0)


def rollout_world_size(cfg: Any) -> int:
    """Workers that run vLLM engines: all of them colocated, the last trainer.rollout_workers split;
    cfg is the config or its plain-dict form."""
    t = cfg["trainer"]
    return t["rollout_workers"] if is_split(cfg) else t["nnodes"] * t["workers_per_node"]


def max_staleness(cfg: Any) -> int:
    """How many steps generation runs ahead of training (rollout.max_staleness; null: 1 split, 0
    colocated); cfg is the config or its plain-dict form."""
    s = cfg["rollout"]["max_staleness"]
    return int(s) if s is not None else (1 if is_split(cfg) else 0)


def is_dpo(cfg: Any) -> bool:
    """The config trains with DPO (hpcrl/trainer/dpo.py), not the RL loop; cfg is the config or its
    plain-dict form."""
    return cfg["algorithm"]["name"] == "dpo"


def critic_enabled(cfg: DictConfig) -> bool:
    if cfg.critic.enable is None and is_dpo(cfg):
        return False
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def reference_enabled(cfg: DictConfig) -> bool:
    if is_dpo(cfg):  # DPO's loss is relative to the reference (reference.enable=false is refused)
        return cfg.reference.enable is not False
    if cfg.reference.enable is not None:
        return cfg.reference.enable
    # a KL loss with coefficient 0 changes nothing: no reference model, no reference forward
    return bool(kl_loss_active(cfg) or cfg.algorithm.use_kl_in_reward)


def kl_loss_active(cfg: Any) -> bool:
    """The actor's loss has a KL term (use_kl_loss with a non-zero coefficient); cfg is the config
    or its plain-dict form."""
    actor = cfg["actor"]
    return bool(actor["use_kl_loss"]) and float(actor["kl_loss_coef"]) != 0.0


def role_layouts(cfg: DictConfig) -> dict[str, Layout]:
    """Training layouts of the enabled Megatron roles (assumes a validated config)."""
    w = trainer_world_size(cfg)
    par = {"actor": cfg.actor.parallel}
    if critic_enabled(cfg):
        par["critic"] = cfg.critic.parallel or cfg.actor.parallel
    if reference_enabled(cfg):
        par["reference"] = cfg.reference.parallel or cfg.actor.parallel
    return {role: Layout(p.tensor_parallel, p.pipeline_parallel, w // (p.tensor_parallel * p.pipeline_parallel))
            for role, p in par.items()}


def rollout_layout(cfg: DictConfig) -> Layout:
    tp = cfg.rollout.tensor_parallel
    return Layout(tp, 1, rollout_world_size(cfg) // tp)


def _get(cfg: DictConfig, dotted: str) -> Any:
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
        problems.append(f"{key}={_get(cfg, key)}: must be a finite number.")
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r}: not one of {', '.join(allowed)}.")
    for key, (lo, hi, lo_inclusive) in RANGES.items():
        value = _get(cfg, key)
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
            value = _get(cfg, f"{role}.optim.{beta}")
            if not 0 <= value < 1:
                problems.append(f"{role}.optim.{beta}={value}: must be >= 0 and < 1 (Adam's moment decay).")
    top_k = cfg.rollout.top_k
    if top_k != -1 and top_k < 1:
        problems.append(f"rollout.top_k={top_k}: must be -1 (off) or >= 1.")
    if not _SLURM_TIME.match(str(cfg.slurm.time)):
        problems.append(f"slurm.time={cfg.slurm.time!r}: not a Slurm time. Use MM, HH:MM:SS or D-HH:MM:SS.")
    if cfg.reward.function != "builtin" and not _ENTRY_POINT.match(cfg.reward.function):
        problems.append(f"reward.function={cfg.reward.function!r}: use 'builtin' or 'package.module:function'.")
    lora = cfg.actor.lora
    if lora.rank:
        from hpcrl.engines.megatron.lora import resolve_targets

        try:
            resolve_targets(list(lora.target_modules))
        except ValueError as e:
            problems.append(f"{e}.")
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
        tp, pp = p.tensor_parallel, p.pipeline_parallel
        if tp < 1 or pp < 1:
            continue  # reported by the range check
        if w % (tp * pp):
            problems.append(
                f"{role}.parallel.tensor_parallel={tp}, {role}.parallel.pipeline_parallel={pp}: "
                f"TP x PP = {tp * pp} does not divide {where}; world size {w} needs TP x PP in "
                f"{{{_divisors(w)}}}.")
        elif p.data_parallel is not None and p.data_parallel * tp * pp != w:
            problems.append(
                f"{role}.parallel.data_parallel={p.data_parallel}: TP x PP x DP = {tp}x{pp}x{p.data_parallel} "
                f"= {tp * pp * p.data_parallel}, but world size is {w} ({where}). "
                f"Use {w // (tp * pp)} or leave it null.")
    rtp, rw = cfg.rollout.tensor_parallel, rollout_world_size(cfg)
    if rtp >= 1 and rw % rtp:
        on = f"the {rw} rollout workers (trainer.rollout_workers)" if is_split(cfg) else where
        size = "the rollout's world size" if is_split(cfg) else "world size"
        problems.append(f"rollout.tensor_parallel={rtp}: does not divide {on}; {size} {rw} needs "
                        f"a rollout TP in {{{_divisors(rw)}}}.")
    # megatron's process groups are per process, and the roles are colocated on the same ranks
    shared = {"critic": cfg.critic.parallel if critic_enabled(cfg) else None, "reference": cfg.reference.parallel}
    a = cfg.actor.parallel
    for role, p in shared.items():
        if p is not None and (p.tensor_parallel, p.pipeline_parallel) != (a.tensor_parallel, a.pipeline_parallel):
            problems.append(f"{role}.parallel: TP={p.tensor_parallel} PP={p.pipeline_parallel} differs from "
                            f"actor.parallel (TP={a.tensor_parallel} PP={a.pipeline_parallel}); colocated Megatron "
                            "roles share one layout. Set both alike (or leave reference.parallel null).")
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
        mb = _get(cfg, f"{role}.ppo_mini_batch_size")
        if mb >= 1 and samples % mb:
            problems.append(f"{role}.ppo_mini_batch_size={mb}: must divide the {samples} samples of a step "
                            f"(data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n}).")
    tp_pp = cfg.actor.parallel.tensor_parallel * cfg.actor.parallel.pipeline_parallel
    mb = cfg.actor.ppo_mini_batch_size
    if tp_pp >= 1 and w % tp_pp == 0 and mb >= 1 and mb % (w // tp_pp):
        problems.append(f"actor.ppo_mini_batch_size={mb}: must be a multiple of the actor's data-parallel "
                        f"size {w // tp_pp}, so every DP rank gets the same number of samples.")


def _check_placement(cfg: DictConfig, problems: list[str]) -> bool:
    """Split placement and asynchronous rollout; False when the worker counts make the layout checks
    meaningless."""
    t, staleness = cfg.trainer, cfg.rollout.max_staleness
    if not is_split(cfg):
        if t.rollout_workers:
            problems.append(f"trainer.rollout_workers={t.rollout_workers}: only for trainer.placement=split (the "
                            "colocated placement runs an engine on every worker). Set the placement or remove it.")
        if staleness:
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
    if max_staleness(cfg) > 0:
        # these make several generation rounds per step, each depending on the last one's results
        for key, on, why in (("algorithm.dynamic_sampling", cfg.algorithm.dynamic_sampling,
                              "refills a batch from what its rewards were"),
                             ("algorithm.adv_estimator", cfg.algorithm.adv_estimator == "remax",
                              "remax generates a greedy baseline with the current weights"),
                             ("rollout.multi_turn.enable", cfg.rollout.multi_turn.enable,
                              "the multi-turn loop drives the engines turn by turn")):
            if on:
                problems.append(f"{key}={_get(cfg, key)}: not with generation ahead of training "
                                f"(rollout.max_staleness={max_staleness(cfg)}): it {why}. Set "
                                "rollout.max_staleness=0 to use it with the split placement.")
    return True


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
    uses = [k for k, on in (("actor.old_logprob=rollout", a.old_logprob == "rollout"),
                            ("algorithm.rollout_correction=tis", cfg.algorithm.rollout_correction == "tis")) if on]
    if cut and uses:
        out.append(f"{' and '.join(cut)} with {' and '.join(uses)}: vLLM's log-probs are renormalised over the "
                   "tokens the cut keeps, the trainer's are over the whole vocabulary, so the ratio between them "
                   "is biased (above 1 on every kept token). Sample without the cut (rollout.top_p=1, "
                   "rollout.top_k=-1), or use actor.old_logprob=recompute without algorithm.rollout_correction.")
    return out


def _check_rollout_correction(cfg: DictConfig, problems: list[str]) -> None:
    if cfg.algorithm.rollout_correction == "tis" and cfg.actor.old_logprob == "rollout":
        problems.append("algorithm.rollout_correction=tis: with actor.old_logprob=rollout the old log-probs are the "
                        "rollout's own and every weight is 1. Use actor.old_logprob=auto or recompute.")


def _check_dpo(cfg: DictConfig, problems: list[str]) -> None:
    """What DPO needs of a config beyond ranges (the RL loop's batch arithmetic does not apply)."""
    d = cfg.algorithm.dpo
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
    tp_pp = cfg.actor.parallel.tensor_parallel * cfg.actor.parallel.pipeline_parallel
    b = cfg.data.train_batch_size
    if tp_pp >= 1 and w % tp_pp == 0 and b >= 1 and b % (w // tp_pp):
        problems.append(f"data.train_batch_size={b}: must be a multiple of the actor's data-parallel size "
                        f"{w // tp_pp}: DPO gives every DP rank whole pairs, the same number each.")


def read_hf_config(model_path: str) -> dict[str, Any]:
    with open(Path(model_path) / "config.json") as f:
        return json.load(f)


def _importable(module: str) -> bool:
    """The module can be found on this process's path (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_class_spec(key: str, spec: Any, builtins: dict[str, Any], check_paths: bool, problems: list[str]) -> None:
    """A `name` or {class: "package.module:Class" | name, kwargs: {...}} entry (tools, tool-call format)."""
    shown = json.dumps(spec) if isinstance(spec, (str, dict, list)) else repr(spec)
    allowed = f"a built-in name ({', '.join(builtins)}) or {{class: 'package.module:Class', kwargs: {{...}}}}"
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - {"class", "kwargs"})
        if unknown:
            problems.append(f"{key}={shown}: unknown keys {unknown}; use {allowed}.")
            return
        if spec.get("kwargs") is not None and not isinstance(spec["kwargs"], dict):
            problems.append(f"{key}.kwargs={json.dumps(spec['kwargs'])}: must be a mapping of keyword arguments.")
            return
        target = spec.get("class")
    else:
        target = spec
    if not isinstance(target, str) or not (target in builtins or _ENTRY_POINT.match(target)):
        problems.append(f"{key}={shown}: use {allowed}.")
        return
    if check_paths and target not in builtins:
        module = target.split(":")[0]
        if not _importable(module):
            problems.append(f"{key}={shown}: module {module!r} is not importable (the controller imports it). "
                            "Put it on PYTHONPATH.")


def _check_multi_turn(cfg: DictConfig, check_paths: bool, problems: list[str]) -> None:
    """rollout.multi_turn: tools and format written as the loader takes them, and what the RL loop's
    other switches cannot do with conversations."""
    from hpcrl.agents.formats import BUILTIN_FORMATS
    from hpcrl.agents.tools import BUILTIN_TOOLS

    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    if is_dpo(cfg):
        problems.append("rollout.multi_turn.enable=true: algorithm.name=dpo trains on fixed preference pairs and "
                        "generates nothing. Set it to false.")
        return
    tools = OmegaConf.to_container(mt.tools, resolve=True)
    if not tools:
        problems.append("rollout.multi_turn.tools: empty; rollout.multi_turn.enable=true needs at least one tool "
                        f"(built-in: {', '.join(BUILTIN_TOOLS)}, or {{class: 'package.module:Class'}}).")
    for i, spec in enumerate(tools):
        _check_class_spec(f"rollout.multi_turn.tools[{i}]", spec, BUILTIN_TOOLS, check_paths, problems)
    fmt = mt.format
    fmt = OmegaConf.to_container(fmt, resolve=True) if OmegaConf.is_config(fmt) else fmt
    _check_class_spec("rollout.multi_turn.format", fmt, BUILTIN_FORMATS, check_paths, problems)
    if cfg.algorithm.overlong_buffer > 0:
        problems.append(f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer}: DAPO's overlong penalty is "
                        "measured against rollout.max_new_tokens, one turn; with rollout.multi_turn.enable=true set "
                        "it to 0 (the token budget is rollout.multi_turn.max_total_tokens).")


def _check_model_shape(cfg: DictConfig, hf: dict[str, Any], problems: list[str]) -> None:
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
    if not (heads and layers):
        problems.append(f"model.path={cfg.model.path!r}: config.json lacks num_attention_heads/"
                        "num_hidden_layers; hpcrl supports Llama- and Qwen2-family models.")
        return
    for role, lay in role_layouts(cfg).items() if not _layout_broken(cfg) else ():
        key = f"{role}.parallel" if role != "reference" or cfg.reference.parallel is not None else "actor.parallel"
        # Megatron splits query heads and KV groups across TP, and whole layers across PP.
        if heads % lay.tp or kv % lay.tp:
            problems.append(f"{key}.tensor_parallel={lay.tp}: the model has {heads} attention heads and {kv} "
                            f"KV heads; TP must divide both (allowed: {_divisors(_gcd(heads, kv))}).")
        if layers % lay.pp:
            problems.append(f"{key}.pipeline_parallel={lay.pp}: the model has {layers} layers; PP must divide "
                            f"it (allowed: {_divisors(layers)}).")
    mt = cfg.rollout.multi_turn
    positions = hf.get("max_position_embeddings")
    if mt.enable and positions and cfg.data.max_prompt_length + mt.max_total_tokens > positions:
        problems.append(f"rollout.multi_turn.max_total_tokens={mt.max_total_tokens}: with data.max_prompt_length="
                        f"{cfg.data.max_prompt_length} a conversation may reach "
                        f"{cfg.data.max_prompt_length + mt.max_total_tokens} tokens, past the model's "
                        f"{positions} positions (max_position_embeddings). Lower one of them.")
    rtp = cfg.rollout.tensor_parallel
    # vLLM replicates KV heads when TP exceeds them, so only the query heads must split evenly.
    if rtp >= 1 and (heads % rtp or (kv % rtp and rtp % kv)):
        problems.append(f"rollout.tensor_parallel={rtp}: the model has {heads} attention heads and {kv} KV "
                        "heads; vLLM needs TP to divide the heads, and the KV heads to divide or be divisible "
                        "by TP.")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _layout_broken(cfg: DictConfig) -> bool:
    w = trainer_world_size(cfg)
    if w < 1:
        return True
    return any(p.tensor_parallel < 1 or p.pipeline_parallel < 1 or w % (p.tensor_parallel * p.pipeline_parallel)
               for p in (cfg.actor.parallel, cfg.critic.parallel or cfg.actor.parallel,
                         cfg.reference.parallel or cfg.actor.parallel))


def _check_paths(cfg: DictConfig, problems: list[str]) -> dict[str, Any] | None:
    hf = None
    mp = Path(cfg.model.path)
    if not (mp / "config.json").is_file():
        why = "does not exist" if not mp.exists() else "has no config.json"
        problems.append(f"model.path={cfg.model.path!r}: {why}. Point it at a local HuggingFace model folder "
                        "(`make models` builds the offline ones into models/).")
    else:
        try:
            hf = read_hf_config(str(mp))
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"model.path={cfg.model.path!r}: config.json unreadable: {e}.")
    if cfg.actor.lora.rank and cfg.actor.lora.adapters:
        a = Path(cfg.actor.lora.adapters)
        if not (a / "adapter_config.json").is_file():
            problems.append(f"actor.lora.adapters={cfg.actor.lora.adapters!r}: no adapter_config.json there; point "
                            "it at a PEFT LoRA folder (`hpcrl ckpt export-hf RUN --lora` writes one).")
    for key in ("model.tokenizer_path", "critic.model_path", "reward.model_path"):
        value = _get(cfg, key)
        if value is not None and not Path(value).exists():
            problems.append(f"{key}={value!r}: does not exist.")
    for key in ("data.train_files", "data.val_files"):
        for i, f in enumerate(_get(cfg, key)):
            if not Path(f).is_file():
                problems.append(f"{key}[{i}]={f!r}: no such file. `make data` writes the arithmetic sets "
                                "into data/.")
            elif not f.endswith((".parquet", ".jsonl", ".json")):
                problems.append(f"{key}[{i}]={f!r}: must be .parquet or .jsonl.")
            elif key == "data.train_files" or cfg.trainer.val_every:
                _check_rows(cfg, f"{key}[{i}]", f, problems)
    if not cfg.data.train_files:
        problems.append("data.train_files: empty. List at least one .parquet or .jsonl file.")
    if cfg.checkpoint.resume not in ("auto", "never") and not Path(cfg.checkpoint.resume).is_dir():
        problems.append(f"checkpoint.resume={cfg.checkpoint.resume!r}: use auto, never, or an existing "
                        "checkpoint folder.")
    fn = cfg.reward.function
    if fn != "builtin" and _ENTRY_POINT.match(fn):
        module = fn.split(":")[0]
        if not _importable(module):
            problems.append(f"reward.function={fn!r}: module {module!r} is not importable. Put it on "
                            "PYTHONPATH on every node.")
    if cfg.logging.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        problems.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r}: wandb is not installed "
                        "(`pip install wandb`), or set logging.wandb.mode=disabled.")
    return hf


def _check_preference_rows(cfg: DictConfig, key: str, path: str, problems: list[str]) -> None:
    """A DPO data file's rows: the preference columns exist, and not too many rows are unusable."""
    from hpcrl.data import scan_preference_rows

    d = cfg.data
    try:
        scan = scan_preference_rows(path, d.prompt_key, d.chosen_key, d.rejected_key)
    except (OSError, ValueError) as e:
        problems.append(f"{key}={path!r}: unreadable ({e})")
        return
    missing = scan.missing_keys(d.prompt_key, d.chosen_key, d.rejected_key)
    if missing:
        names = {d.prompt_key: "data.prompt_key", d.chosen_key: "data.chosen_key", d.rejected_key: "data.rejected_key"}
        problems.append(f"{key}={path!r}: no row has {', '.join(f'{k!r} ({names[k]})' for k in missing)}; "
                        "algorithm.name=dpo reads preference pairs in TRL's schema: prompt, chosen, rejected "
                        f"(columns present: {', '.join(sorted(scan.keys_seen)) or 'none'}).")
        return
    refusal = scan.refusal(d.max_skipped_row_share)
    if refusal:
        problems.append(f"{key}={path!r}: {refusal}")


def _check_rows(cfg: DictConfig, key: str, path: str, problems: list[str]) -> None:
    """A data file's rows, read now rather than after the workers have started (or a day in a Slurm
    queue): not too many unusable ones, and a builtin reward rule for every data_source."""
    from hpcrl.data import scan_rows
    from hpcrl.rewards.builtin import known_data_sources, style_of

    if is_dpo(cfg):
        _check_preference_rows(cfg, key, path, problems)
        return
    try:
        scan = scan_rows(path, cfg.data.prompt_key)
    except (OSError, ValueError) as e:
        problems.append(f"{key}={path!r}: unreadable ({e})")
        return
    refusal = scan.refusal(cfg.data.max_skipped_row_share)
    if refusal:
        problems.append(f"{key}={path!r}: {refusal}")
    if cfg.reward.function != "builtin":
        return
    for source, rows in scan.sources().items():
        if style_of(source) is None:
            shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
            problems.append(f"{key}={path!r}: data_source {source!r} ({len(rows)} rows: {shown}) has no rule in "
                            f"reward.function=builtin (it knows: {', '.join(known_data_sources())}). Set "
                            "reward.function to a 'package.module:function' that scores it, or fix the rows.")


def validate(cfg: DictConfig, check_paths: bool = True) -> None:
    """Raise ConfigError listing every problem. `check_paths=False` skips files and the model's shape
    (for preparing a cluster recipe on a machine that cannot see the cluster's filesystem)."""
    problems: list[str] = []
    _check_choices_and_ranges(cfg, problems)
    _check_layout(cfg, problems)
    _check_rl_switches(cfg, problems)
    _check_multi_turn(cfg, check_paths, problems)
    if check_paths:
        hf = _check_paths(cfg, problems)
        if hf is not None:
            _check_model_shape(cfg, hf, problems)
    if problems:
        raise ConfigError(problems)
