"""The engine a model role runs on, built from the resolved config: the Megatron-core engine
(hpcrl.engines.megatron) or the FSDP2 engine (hpcrl.engines.fsdp), with the role's optimizer, LoRA,
MoE and packing settings read from its section. The role (megatron_roles.MegatronRole) calls
`build_engine` and knows neither engine's options.

- `resolve_dtype`: model.dtype (auto: bf16 on GPUs, fp32 on CPU).
- `use_layout`: Megatron's process-global parallel state, set once for the colocated roles.
- `optim_settings`, `lora_settings` / `lora_options`: the role's optimizer, the actor's LoRA.
- `megatron_engine`, `fsdp_engine`, `build_engine`: the engine of a role (its `engine` key, default
  the actor's).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.config.derived import role_engine
from hpcrl.engines.megatron.engine import EngineOptions, MegatronEngine, OptimSettings, init_model_parallel
from hpcrl.engines.megatron.lora import LoraSettings, resolve_targets
from hpcrl.engines.megatron.moe import MoeSettings

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_layout_in_use: tuple[int, int, int, int] | None = None


def resolve_dtype(name: str) -> torch.dtype:
    """auto: bf16 on GPUs, fp32 on CPU (bf16 log-probs drift by up to 0.19 nats there)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return DTYPES[name]


def use_layout(tp: int, pp: int, seed: int, cp: int = 1, ep: int = 1) -> None:
    """megatron's parallel_state is process-global: colocated roles must share one layout."""
    global _layout_in_use
    if _layout_in_use == (tp, pp, cp, ep):
        return
    init_model_parallel(tp, pp, seed=seed, cp=cp, ep=ep)
    _layout_in_use = (tp, pp, cp, ep)


def lora_options(cfg: dict[str, Any]) -> tuple[LoraSettings | None, str | None]:
    """The actor's LoRA settings and the PEFT folder to start from (either engine)."""
    settings = lora_settings(cfg)
    return settings, (cfg["actor"].get("lora") or {}).get("adapters") if settings else None


def lora_settings(cfg: dict[str, Any]) -> LoraSettings | None:
    """The actor's LoRA settings from a resolved config (None: full fine-tuning)."""
    lora = cfg["actor"].get("lora") or {}
    if not lora.get("rank"):
        return None
    return LoraSettings(rank=int(lora["rank"]), alpha=float(lora["alpha"]), dropout=float(lora["dropout"]),
                        targets=resolve_targets(list(lora["target_modules"])), seed=int(cfg["trainer"]["seed"]))


def optim_settings(cfg: dict[str, Any], role: str) -> OptimSettings | None:
    """The optimizer of a role that trains (actor, critic); None for the others. The schedule counts
    optimizer steps: mini-batches x epochs per training step."""
    if role not in ("actor", "critic"):
        return None
    section = cfg[role]
    o = section["optim"]
    n_mini = max(cfg["data"]["train_batch_size"] * cfg["rollout"]["n"] // section["ppo_mini_batch_size"], 1)
    return OptimSettings(lr=o["lr"], min_lr=o["min_lr"], lr_schedule=o["lr_schedule"],
                         warmup_steps=o["warmup_steps"], weight_decay=o["weight_decay"],
                         betas=(o["adam_beta1"], o["adam_beta2"]), eps=o["adam_eps"],
                         clip_grad=o["clip_grad"], shard_over_dp=o["shard_over_dp"],
                         total_steps=cfg["trainer"]["total_steps"] * n_mini * section["ppo_epochs"])


def build_engine(cfg: dict[str, Any], role: str, path: str, ranks: list[int] | None = None) -> Any:
    """The engine of `role` over the model at `path`: FSDP when the role's engine is fsdp, else Megatron."""
    optim = optim_settings(cfg, role)
    if role_engine(cfg, role) == "fsdp":
        return fsdp_engine(cfg, role, path, optim, ranks)
    return megatron_engine(cfg, role, path, optim)


def megatron_engine(cfg: dict[str, Any], role: str, path: str, optim: OptimSettings | None) -> MegatronEngine:
    """The Megatron-core engine of a role; the reference and critic take the actor's layout unless
    they set their own (they are colocated with it)."""
    section, trains = cfg[role], optim is not None
    par = section.get("parallel") or cfg["actor"]["parallel"]
    use_layout(par["tensor_parallel"], par["pipeline_parallel"], seed=cfg["trainer"]["seed"],
               cp=par.get("context_parallel", 1), ep=par.get("expert_parallel", 1))
    src = section if trains else cfg["actor"]
    options = EngineOptions(dtype=resolve_dtype(cfg["model"]["dtype"]), attention=cfg["model"]["local_attention"],
                            micro_batch_tokens=src["micro_batch_tokens"], packing=src["packing"],
                            micro_batch_size=src["micro_batch_size"],
                            share_prompt=cfg["actor"]["share_prompt"],
                            sequence_parallel=bool(par.get("sequence_parallel", False)),
                            # the reference only runs forwards: nothing to recompute
                            recompute=section.get("recompute", "none") if trains else "none")
    moe = section.get("moe") if trains else None
    if moe:
        options.moe = MoeSettings(aux_loss_coeff=float(moe.get("aux_loss_coeff", 0.0)),
                                  z_loss_coeff=float(moe.get("z_loss_coeff", 0.0)),
                                  # the actor's forwards replay the rollout's experts (R3)
                                  routing_replay=role == "actor" and bool(cfg["rollout"].get("routing_replay")))
    if role == "actor":
        options.lora, options.lora_adapters = lora_options(cfg)
    return MegatronEngine(path, options, value_head=role == "critic", optim=optim)


def fsdp_engine(cfg: dict[str, Any], role: str, path: str, optim: OptimSettings | None,
                ranks: list[int] | None = None) -> Any:
    """The FSDP2 engine (hpcrl.engines.fsdp) over the HF model; `ranks` (tests): the torch ranks it
    shards over, default every worker."""
    from hpcrl.engines.fsdp.engine import FsdpEngine, FsdpOptions

    section, trains = cfg[role], optim is not None
    src = section if trains else cfg["actor"]
    fsdp = cfg["actor"]["fsdp"]  # (one set of FSDP options for every role on the engine)
    options = FsdpOptions(dtype=resolve_dtype(cfg["model"]["dtype"]), micro_batch_tokens=src["micro_batch_tokens"],
                          packing=src["packing"], micro_batch_size=src["micro_batch_size"],
                          share_prompt=cfg["actor"]["share_prompt"],
                          recompute=section.get("recompute", "none") if trains else "none",
                          cpu_offload=bool(fsdp.get("cpu_offload", False)),
                          reshard_after_forward=bool(fsdp.get("reshard_after_forward", True)),
                          accumulate_unsharded=bool(fsdp.get("accumulate_unsharded", False)),
                          attn_implementation=fsdp.get("attn_implementation"))
    if role == "actor":
        options.lora, options.lora_adapters = lora_options(cfg)
    return FsdpEngine(path, options, value_head=role == "critic", optim=optim, ranks=ranks)
