"""The training engines' keys: `actor.engine` / `critic.engine` / `reference.engine` (megatron | fsdp)
against the options each engine has. Value checks only (hpcrl.config.validate calls them); whether
transformers or the Megatron converter builds the model is the preflight's (hpcrl.trainer.preflight).
"""

from __future__ import annotations

from omegaconf import DictConfig

from hpcrl.config.derived import engine_roles, role_parallel

# transformers' attention implementations (AttentionInterface's names and eager); a hub kernel is "org/repo"
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")


def engine_problems(cfg: DictConfig) -> list[str]:
    """Each engine's options only with that engine; what the FSDP engine does not do, refused by key."""
    problems: list[str] = []
    engines = engine_roles(cfg)
    if any(e not in ("megatron", "fsdp") for e in engines.values()):
        return problems  # reported by the choices
    if "fsdp" not in engines.values():
        defaults = {"cpu_offload": False, "reshard_after_forward": True, "accumulate_unsharded": False,
                    "attn_implementation": None}
        for key, default in defaults.items():
            if cfg.actor.fsdp[key] != default:
                problems.append(f"actor.fsdp.{key}={cfg.actor.fsdp[key]}: an option of the FSDP engine, and no role "
                                "runs on it. Set actor.engine=fsdp, or drop the key.")
        return problems
    attention = cfg.actor.fsdp.attn_implementation
    if attention is not None and attention not in ATTENTION and "/" not in str(attention):
        problems.append(f"actor.fsdp.attn_implementation={attention}: not an attention implementation of "
                        f"transformers. Choose one of {', '.join(ATTENTION)}, a hub kernel (org/repo), or null.")
    elif str(attention).startswith("flash") and cfg.trainer.device == "cpu":
        problems.append(f"actor.fsdp.attn_implementation={attention}: flash attention needs a CUDA device "
                        "(trainer.device=cpu). Set it to null (sdpa) or sdpa.")
    for role, engine in engines.items():
        if engine != "fsdp":
            continue
        key = f"{role}.parallel" if role == "actor" or cfg[role].parallel is not None else "actor.parallel"
        p = role_parallel(cfg, role)
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            if p[name] != 1:
                problems.append(f"{key}.{name}={p[name]}: the FSDP engine ({role}) shards over data parallel "
                                f"only. Set it to 1, or {role}.engine=megatron.")
        if p.sequence_parallel:
            problems.append(f"{key}.sequence_parallel=true: a Megatron option; the FSDP engine ({role}) has no "
                            f"tensor parallel. Set it to false, or {role}.engine=megatron.")
        if role in ("actor", "critic") and cfg[role].recompute == "selective":
            problems.append(f"{role}.recompute=selective: the FSDP engine recomputes whole layers (full) or "
                            "nothing (none).")
    if engines["actor"] == "fsdp":
        if cfg.rollout.routing_replay:
            problems.append("rollout.routing_replay=true: the FSDP engine routes its MoE layers itself (no "
                            "replay). Set actor.engine=megatron for routing replay.")
    return problems
