"""May this checkpoint resume under this config? The keys that make a run what it is must match.

A resumed run may come back on another allocation: other workers and nodes, another TP/PP/DP/EP
(the Megatron state converts, hpcrl.checkpoint.megatron_state), the other placement, another rollout
TP, and with another length, learning rate or logging. What it may not change, because the resumed
run would silently train something else than the run it continues:

  - the model's architecture (`ARCH_KEYS` of each model folder's config.json; the checkpoint's
    weights replace the model's, so another folder holding the same architecture, a copy moved to
    another cluster, is accepted and logged);
  - the training engine of the actor and the critic (actor.engine, critic.engine: a Megatron checkpoint
    holds Megatron shards, an FSDP one DCP shards; older checkpoints are Megatron's);
  - the loop: algorithm.name, whether a critic trains (algorithm.adv_estimator=gae), LoRA
    (actor.lora.rank / alpha / target_modules: the checkpoint holds adapters or full weights);
  - the prompts and the samples: data.train_files (by file name: a data folder may move), data.seed,
    data.shuffle, data.max_prompt_length (which prompts are kept) and trainer.seed (the sampling
    seeds of every step derive from it);
  - samples the checkpoint holds: a fully_async stream resumes only fully_async with the same
    rollout.n, batches generated ahead only without fully_async (else their prompts would be skipped).

`resume_problems` runs in the preflight (`hpcrl run`, `hpcrl submit`, the Slurm launcher), so a
refusal comes before any process or allocation starts and nothing in the run directory changes;
`changed_keys` lists what the resumed run does change, for the resume's log line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# what decides the tensors of a model (and so which checkpoint weights fit it)
ARCH_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
             "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
# dotted keys a resumed run must keep (besides the model's architecture and whether a critic trains)
FIXED_KEYS = ("algorithm.name", "actor.lora.rank", "actor.lora.alpha", "actor.lora.target_modules", "data.seed",
              "data.shuffle", "data.max_prompt_length", "trainer.seed")
# keys whose change is the point of a resume elsewhere, or says nothing about the training: not logged
WHERE_KEYS = ("trainer.run_dir", "trainer.nnodes", "trainer.workers_per_node", "trainer.total_steps",
              "checkpoint.resume", "checkpoint.dir", "logging.dir", "slurm.")


def architecture(model_path: str | Path) -> dict[str, Any] | None:
    """ARCH_KEYS of a model folder's config.json (None where it has none or it is unreadable)."""
    try:
        hf = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return {k: hf[k] for k in ARCH_KEYS if k in hf}


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def saved_config(folder: str | Path) -> dict[str, Any]:
    """The resolved config a checkpoint folder was written with."""
    from omegaconf import OmegaConf

    from hpcrl.checkpoint.store import CONFIG

    loaded = OmegaConf.to_container(OmegaConf.load(Path(folder) / CONFIG), resolve=True)
    return loaded if isinstance(loaded, dict) else {}


def saved_architecture(folder: str | Path, saved: dict[str, Any]) -> dict[str, Any] | None:
    """The model architecture a checkpoint was written for: recorded in its controller state since
    it has been (`model_architecture`), else read from its config's model.path if that still exists."""
    from hpcrl.checkpoint.store import CONTROLLER_STATE

    try:
        state = json.loads((Path(folder) / CONTROLLER_STATE).read_text())
    except (OSError, json.JSONDecodeError):
        state = {}
    if state.get("model_architecture") is not None:
        return dict(state["model_architecture"])
    path = _get(saved, "model.path")
    return architecture(path) if path else None


def _critic(tree: dict[str, Any]) -> bool:
    return _get(tree, "algorithm.adv_estimator") == "gae" and _get(tree, "algorithm.name") != "dpo"


def _engine(tree: dict[str, Any], role: str) -> str:
    """The engine a role trained on (configs from before actor.engine existed: megatron)."""
    own = _get(tree, f"{role}.engine") if role != "actor" else None
    return str(own or _get(tree, "actor.engine") or "megatron")


def resume_problems(folder: str | Path, cfg: dict[str, Any]) -> list[str]:
    """What in `cfg` (a resolved config as plain data) differs from the checkpoint `folder`'s config
    in a way a resumed run cannot take (the module docstring), each naming the key and both values."""
    saved = saved_config(folder)
    diffs = []
    for key in FIXED_KEYS:
        there, here = _get(saved, key), _get(cfg, key)
        if there != here:
            diffs.append(f"{key}: {there!r} in the checkpoint, {here!r} now")
    names = [[Path(str(f)).name for f in (_get(t, "data.train_files") or [])] for t in (saved, cfg)]
    if names[0] != names[1]:
        diffs.append(f"data.train_files: {names[0]} in the checkpoint, {names[1]} now (compared by file name)")
    for role in ("actor", "critic") if _critic(cfg) else ("actor",):
        there, here = _engine(saved, role), _engine(cfg, role)
        if there != here:
            diffs.append(f"{role}.engine: {there!r} in the checkpoint, {here!r} now (each engine loads its own "
                         "checkpoints)")
    if _critic(saved) != _critic(cfg):
        diffs.append(f"algorithm.adv_estimator: {_get(saved, 'algorithm.adv_estimator')!r} in the checkpoint, "
                     f"{_get(cfg, 'algorithm.adv_estimator')!r} now (a critic trains with gae only)")
    old, new = saved_architecture(folder, saved), architecture(str(_get(cfg, "model.path")))
    if old is not None and new is not None and old != new:
        keys = [k for k in ARCH_KEYS if old.get(k) != new.get(k)]
        shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
        diffs.append(f"model.path: {_get(cfg, 'model.path')!r} is another model than the checkpoint's "
                     f"{_get(saved, 'model.path')!r} ({shown})")
    diffs += _rollout_state_problems(Path(folder), saved, cfg)
    if not diffs:
        return []
    return [f"checkpoint.resume: the checkpoint {folder} was written by a run this config cannot continue: "
            + "; ".join(diffs) + ". A resumed run keeps these (its layout, allocation, placement, length and "
            "learning rate may change); to start another run, give it another trainer.run_dir."]


def _stream_groups(path: Path) -> int:
    """How many groups a saved fully_async stream holds (0 once a run has trained all it drew)."""
    import torch

    try:
        return len(torch.load(path, weights_only=True).get("groups", []))
    except Exception:  # unreadable: the resume itself will say so; not this check's business
        return 1


def _rollout_state_problems(folder: Path, saved: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Samples a checkpoint holds that only the same kind of rollout continues: the fully asynchronous
    stream (hpcrl.trainer.stream: groups of rollout.n samples) or the batches generated ahead
    (hpcrl.trainer.ahead). Another mode would skip their prompts (the sampler has moved past them)."""
    from hpcrl.config.derived import rollout_mode

    mode = rollout_mode(cfg)
    out = []
    if (folder / "stream.pt").is_file() and _stream_groups(folder / "stream.pt"):
        if mode != "fully_async":
            out.append(f"rollout.mode: the checkpoint holds the samples of a fully_async stream, {mode!r} now would "
                       "skip their prompts (resume with rollout.mode=fully_async)")
        elif _get(saved, "rollout.n") != _get(cfg, "rollout.n"):
            out.append(f"rollout.n: {_get(saved, 'rollout.n')!r} in the checkpoint, {_get(cfg, 'rollout.n')!r} now "
                       "(its stream holds groups of the former)")
    if (folder / "rollouts_ahead.pt").is_file() and mode == "fully_async":
        out.append("rollout.mode: the checkpoint holds batches generated ahead (one_step_off), 'fully_async' now "
                   "would skip their prompts (resume with rollout.mode=one_step_off or sync)")
    return out


def changed_keys(folder: str | Path, cfg: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every key a resumed run changes, leaving out where it runs and for how long."""
    old, new = _flat(saved_config(folder)), _flat(cfg)
    old_dir, new_dir = str(old.get("trainer.run_dir")), str(new.get("trainer.run_dir"))

    def moved(a: Any, b: Any) -> bool:  # a path under the run directory, which moved with it
        return isinstance(a, str) and isinstance(b, str) and a.replace(old_dir, new_dir) == b

    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not k.startswith(WHERE_KEYS) and not moved(old.get(k), new.get(k))]
