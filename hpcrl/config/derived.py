"""Quantities derived from a config: world sizes, layouts, which roles and terms are on, how far
generation runs ahead of training. Plain functions of the config (or of its plain-dict form, where
they say so), used by validation, the planner, the trainer and the workers alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one role over the worker ranks: TP x PP x CP x DP of them, with sequence
    parallel on or off, and EP (expert parallel, MoE layers: carved out of the DP x CP ranks). cp, sp
    and ep last, with defaults, so that `Layout(tp, pp, dp)` still reads as it did before context
    parallel."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    sp: bool = False
    ep: int = 1

    def __str__(self) -> str:
        # CP, EP and SP only when used: the layouts most runs print stay as they were
        cp = f" CP={self.cp}" if self.cp > 1 else ""
        ep = f" EP={self.ep}" if self.ep > 1 else ""
        return f"TP={self.tp} PP={self.pp}{cp}{ep} DP={self.dp}" + (" SP" if self.sp else "")

    @property
    def token_multiple(self) -> int:
        """What a packed row's length (and a packing budget) is a multiple of: `token_multiple`."""
        return token_multiple(self.tp, self.cp, self.sp)


def token_multiple(tp: int, cp: int, sp: bool) -> int:
    """What the engine pads a packed row's length to a multiple of (hpcrl.engines.megatron.forward):
    with CP every sequence is cut into 2 x CP equal chunks, and with SP each rank's part of the row is
    cut again over the TP ranks; 1 without either."""
    return (2 * cp if cp > 1 else 1) * (tp if sp else 1)


def cp_padded_length(length: int, cp: int) -> int:
    """The places a sequence of `length` tokens takes in a context-parallel row: rounded up to a
    multiple of 2 x CP, its 2 x CP equal chunks (hpcrl.engines.megatron.context_parallel)."""
    return length if cp <= 1 else -(-length // (2 * cp)) * (2 * cp)


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


def rollout_mode(cfg: Any) -> str:
    """sync | one_step_off | fully_async: rollout.mode, or when null what rollout.max_staleness and the
    placement give (one_step_off split with a bound above 0, else sync); cfg as for staleness_depth."""
    r = cfg["rollout"]
    if r.get("mode") is not None:
        return str(r["mode"])
    s = r["max_staleness"]
    return "one_step_off" if is_split(cfg) and (s is None or int(s) > 0) else "sync"


def staleness_depth(cfg: Any) -> int:
    """How many steps generation runs ahead of training in batches (hpcrl.trainer.ahead):
    rollout.max_staleness under one_step_off (null: 1), else 0; cfg is the config or its plain-dict
    form."""
    if rollout_mode(cfg) != "one_step_off":
        return 0
    s = cfg["rollout"]["max_staleness"]
    return int(s) if s is not None else 1


def stream_staleness(cfg: Any) -> int:
    """fully_async: the most weight versions a trained token may be behind the trainer
    (rollout.max_staleness; null: 1)."""
    s = cfg["rollout"]["max_staleness"]
    return int(s) if s is not None else 1


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


def role_engine(cfg: Any, role: str) -> str:
    """megatron | fsdp: the training engine a role runs on (its `engine`, default the actor's); cfg is
    the config or its plain-dict form."""
    own = cfg[role]["engine"] if role != "actor" else None
    return own or cfg["actor"]["engine"]


def engine_summary(cfg: DictConfig) -> str:
    """The actor's engine in words, for logs: Megatron with its parallel section, or FSDP2."""
    if cfg.actor.engine == "fsdp":
        return "FSDP2 over the HF model, data parallel"
    return f"Megatron {dict(cfg.actor.parallel)}"


def engine_roles(cfg: DictConfig) -> dict[str, str]:
    """The enabled model roles and the engine each runs on."""
    roles = ["actor"] + (["critic"] if critic_enabled(cfg) else []) + (["reference"] if reference_enabled(cfg) else [])
    return {role: role_engine(cfg, role) for role in roles}


def role_parallel(cfg: DictConfig, role: str) -> Any:
    """The `parallel` section a Megatron role runs with: its own, or the actor's when it is null."""
    if role == "actor":
        return cfg.actor.parallel
    return cfg[role].parallel or cfg.actor.parallel


def role_layouts(cfg: DictConfig) -> dict[str, Layout]:
    """Training layouts of the enabled Megatron roles (assumes a validated config): DP is what
    TP x PP x CP leave of the trainer's workers."""
    w = trainer_world_size(cfg)
    roles = ["actor"] + (["critic"] if critic_enabled(cfg) else []) + (["reference"] if reference_enabled(cfg) else [])
    out = {}
    for role in roles:
        p = role_parallel(cfg, role)
        tp, pp, cp = p.tensor_parallel, p.pipeline_parallel, p.context_parallel
        out[role] = Layout(tp, pp, w // (tp * pp * cp), cp, bool(p.sequence_parallel), p.expert_parallel)
    return out


def rollout_layout(cfg: DictConfig) -> Layout:
    tp = cfg.rollout.tensor_parallel
    return Layout(tp, 1, rollout_world_size(cfg) // tp)
