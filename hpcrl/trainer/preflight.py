"""The preflight: every check of a config that reads files or knows what another package holds, run
by `hpcrl config`, `plan`, `run` and `submit` (and by the trainer and the Slurm launcher) before any
process or allocation starts, with the same exit 2 naming the key as the config's own validation.

  - the values (hpcrl.config.validate: types, ranges, the arithmetic between keys)
  - the registries: LoRA targets against the engine's layers, multi-turn tools and formats against
    the agents' built-ins, custom classes and reward modules importable
  - with check_paths (not `--skip-path-checks`): the model folder, its architecture, and its shape
    (heads, layers, experts) against the layouts, the MoE keys and the LoRA targets (attention only on
    an MoE model),
    data files and their rows (usable, and each data_source scorable by the builtin reward), the
    adapters' folder, the resume folder, wandb installed, and that the checkpoint the run would
    resume from was written by a run this config can continue (hpcrl.checkpoint.compat)

Why here and not in hpcrl/config: the config is plain data that imports no other hpcrl package
(tests/test_layering.py); these checks need the engines, data, rewards and agents, which the trainer
already depends on.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hpcrl.config import ConfigError
from hpcrl.config.derived import cp_padded_length, engine_roles, is_dpo, role_layouts, trainer_world_size
from hpcrl.config.validate import ENTRY_POINT, dotted_value, value_problems


def preflight(cfg: DictConfig, check_paths: bool = True) -> None:
    """Raise ConfigError listing every problem: the values', the registries', and (check_paths) the
    files' and the model's."""
    problems = value_problems(cfg)
    _check_lora_targets(cfg, problems)
    _check_multi_turn_registry(cfg, check_paths, problems)
    if check_paths:
        hf = _check_paths(cfg, problems)
        # the Megatron engine converts the families it knows; the FSDP engine builds what transformers builds
        check = (_check_architecture if "megatron" in engine_roles(cfg).values() else _check_transformers_builds)
        if hf is not None and check("model.path", cfg.model.path, hf, problems):
            _check_model_shape(cfg, hf, problems)
            _check_experts(cfg, hf, problems)
            _check_lora_moe_targets(cfg, hf, problems)
    if problems:
        raise ConfigError(problems)


def _check_lora_targets(cfg: DictConfig, problems: list[str]) -> None:
    lora = cfg.actor.lora
    if not lora.rank:
        return
    from hpcrl.engines.megatron.lora import resolve_targets

    try:
        resolve_targets(list(lora.target_modules))
    except ValueError as e:
        problems.append(f"{e}.")


def _check_lora_moe_targets(cfg: DictConfig, hf: dict[str, Any], problems: list[str]) -> None:
    """LoRA targets against an MoE model (num_experts or num_local_experts > 0): its MLPs are a router
    and experts, which LoRA does not adapt; all-linear means the attention there, MLP layers named in
    actor.lora.target_modules are refused (hpcrl.engines.megatron.lora.resolve_targets)."""
    lora = cfg.actor.lora
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if not lora.rank or not experts:
        return
    from hpcrl.engines.megatron.lora import resolve_targets

    names = list(lora.target_modules)
    try:
        resolve_targets(names)
    except ValueError:
        return  # _check_lora_targets reports it
    try:
        resolve_targets(names, moe=True)
    except ValueError as e:
        problems.append(f"{e} (model.path={cfg.model.path!r} has {experts} experts per layer).")


def _check_multi_turn_registry(cfg: DictConfig, check_paths: bool, problems: list[str]) -> None:
    """rollout.multi_turn's tools and format written as the agents' loader takes them."""
    mt = cfg.rollout.multi_turn
    if not mt.enable or is_dpo(cfg):
        return
    from hpcrl.agents.builtin_tools import BUILTIN_TOOLS
    from hpcrl.agents.formats import BUILTIN_FORMATS

    tools = OmegaConf.to_container(mt.tools, resolve=True)
    if not tools:
        problems.append("rollout.multi_turn.tools: empty; rollout.multi_turn.enable=true needs at least one tool "
                        f"(built-in: {', '.join(BUILTIN_TOOLS)}, or {{class: 'package.module:Class'}}).")
    for i, spec in enumerate(tools):
        _check_class_spec(f"rollout.multi_turn.tools[{i}]", spec, BUILTIN_TOOLS, check_paths, problems)
    fmt = mt.format
    fmt = OmegaConf.to_container(fmt, resolve=True) if OmegaConf.is_config(fmt) else fmt
    _check_class_spec("rollout.multi_turn.format", fmt, BUILTIN_FORMATS, check_paths, problems)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


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
    if not isinstance(target, str) or not (target in builtins or ENTRY_POINT.match(target)):
        problems.append(f"{key}={shown}: use {allowed}.")
        return
    if check_paths and target not in builtins:
        module = target.split(":")[0]
        if not _importable(module):
            problems.append(f"{key}={shown}: module {module!r} is not importable (the controller imports it). "
                            "Put it on PYTHONPATH.")


def _check_model_shape(cfg: DictConfig, hf: dict[str, Any], problems: list[str]) -> None:
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
    if not (heads and layers):
        problems.append(f"model.path={cfg.model.path!r}: config.json lacks num_attention_heads/"
                        "num_hidden_layers; hpcrl supports Llama-, Qwen2- and Qwen3-family models.")
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
    if positions and not _layout_broken(cfg):
        _check_cp_padding(cfg, int(positions), problems)
    rtp = cfg.rollout.tensor_parallel
    # vLLM replicates KV heads when TP exceeds them, so only the query heads must split evenly.
    if rtp >= 1 and (heads % rtp or (kv % rtp and rtp % kv)):
        problems.append(f"rollout.tensor_parallel={rtp}: the model has {heads} attention heads and {kv} KV "
                        "heads; vLLM needs TP to divide the heads, and the KV heads to divide or be divisible "
                        "by TP.")


def _check_architecture(key: str, path: str, hf: dict[str, Any], problems: list[str]) -> bool:
    """The model's architecture is one the engine converts (hpcrl.engines.megatron.architectures.SUPPORTED)."""
    from hpcrl.engines.megatron.architectures import SUPPORTED

    arch = (hf.get("architectures") or [None])[0]
    if arch in SUPPORTED:
        return True
    problems.append(f"{key}={path!r}: architecture {arch!r} (config.json's architectures) is not one hpcrl "
                    f"converts: {', '.join(sorted(SUPPORTED))}. Or set actor.engine=fsdp (the FSDP engine builds any "
                    "causal LM transformers builds).")
    return False


def _check_transformers_builds(key: str, path: str, hf: dict[str, Any], problems: list[str]) -> bool:
    """The FSDP engine builds the model with transformers' AutoModelForCausalLM: its config must name
    a causal LM transformers knows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"{key}={path!r}: transformers cannot read its config.json ({str(e).splitlines()[0]}); the "
                        "FSDP engine builds the model with transformers.")
        return False
    if type(config) not in AutoModelForCausalLM._model_mapping:
        problems.append(f"{key}={path!r}: model_type {hf.get('model_type')!r} is not a causal LM transformers "
                        "builds (AutoModelForCausalLM); the FSDP engine needs one.")
        return False
    return True


def _check_experts(cfg: DictConfig, hf: dict[str, Any], problems: list[str]) -> None:
    """The MoE keys against the model: a dense one (no num_experts) takes none of them; an MoE one
    has every layer MoE, no shared experts, and experts that split evenly over EP."""
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)  # (transformers 5 writes the latter)
    where = f"model.path={cfg.model.path!r}"
    layouts = role_layouts(cfg) if not _layout_broken(cfg) else {}
    # the roles whose `parallel` block is their own (the others run with the actor's)
    roles = [r for r in layouts if r == "actor" or cfg[r].parallel is not None]
    if not experts:
        dense = f"the model ({where}) is dense (no num_experts in its config.json)"
        keys = [f"{r}.parallel.expert_parallel" for r in roles if layouts[r].ep > 1]
        for key in keys:
            problems.append(f"{key}={dotted_value(cfg, key)}: {dense}; expert parallel splits the experts of MoE "
                            "layers. Set it to 1.")
        for role in ("actor", "critic") if "critic" in layouts else ("actor",):
            if role == "critic" and cfg.critic.model_path:
                continue  # the critic's own model: its config is not read here
            for coeff in ("aux_loss_coeff", "z_loss_coeff"):
                key = f"{role}.moe.{coeff}"
                if dotted_value(cfg, key) > 0:  # (below 0: the range check reports it)
                    problems.append(f"{key}={dotted_value(cfg, key)}: {dense}; it has no routers to regularise. "
                                    "Set it to 0.")
        if cfg.rollout.routing_replay and not is_dpo(cfg):
            problems.append(f"rollout.routing_replay=true: {dense}; there is no expert routing to replay. Set it "
                            "to false.")
        return
    if cfg.rollout.routing_replay and not is_dpo(cfg) and "actor" in layouts and layouts["actor"].pp > 1:
        problems.append(f"rollout.routing_replay=true with actor.parallel.pipeline_parallel={layouts['actor'].pp}: "
                        "routing replay across pipeline stages is not supported yet (no hpcrl check has run it). "
                        "Set actor.parallel.pipeline_parallel=1, or rollout.routing_replay=false.")
    dense_layers = list(hf.get("mlp_only_layers") or [])
    if dense_layers or hf.get("decoder_sparse_step", 1) not in (1, None):
        problems.append(f"{where}: MoE on some layers only (mlp_only_layers={dense_layers}, decoder_sparse_step="
                        f"{hf.get('decoder_sparse_step')}); hpcrl supports MoE models whose every layer is MoE.")
    if int(hf.get("shared_expert_intermediate_size") or 0) > 0:
        problems.append(f"{where}: shared experts (shared_expert_intermediate_size="
                        f"{hf['shared_expert_intermediate_size']}) are not supported yet; hpcrl supports MoE models "
                        "with routed experts only.")
    for role in roles:
        lay = layouts[role]
        if lay.ep >= 1 and experts % lay.ep:  # (EP < 1: the range check reports it)
            room = lay.dp * lay.cp
            fits = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0 and room % d == 0)
            problems.append(f"{role}.parallel.expert_parallel={lay.ep}: the model has {experts} experts per MoE layer "
                            f"(num_experts); EP must divide them, and the {role}'s DP x CP = {room}. Use "
                            f"expert_parallel in {{{fits}}}.")
        trains = role == "actor" or (role == "critic" and not cfg.critic.model_path)
        if trains and lay.cp > 1:  # (issue 55: accepted before, never run)
            problems.append(f"{role}.parallel.context_parallel={lay.cp}: an MoE model with context parallel is not "
                            "supported yet (no hpcrl check has run the experts' token dispatch or routing replay "
                            "across CP ranks). Set it to 1; for long sequences of an MoE model use tensor and "
                            "expert parallel.")
        if trains and lay.tp > 1 and not lay.sp:
            problems.append(f"{role}.parallel.sequence_parallel=false: an MoE model trains at tensor parallel "
                            f"{lay.tp} with sequence parallel only (megatron's MoE layer refuses TP without it). "
                            f"Set {role}.parallel.sequence_parallel=true, or tensor_parallel=1.")


def _longest_sample(cfg: DictConfig) -> tuple[int, str]:
    """The most tokens a training sequence can hold, and the keys that make it: the prompt and its
    completion (the multi-turn budget when larger, as hpcrl.workers.actor_rollout.tokens_after_prompt),
    or DPO's prompt and response."""
    d, r = cfg.data, cfg.rollout
    if is_dpo(cfg):
        return d.max_prompt_length + d.max_response_length, "data.max_prompt_length + data.max_response_length"
    if r.multi_turn.enable and r.multi_turn.max_total_tokens > r.max_new_tokens:
        return (d.max_prompt_length + r.multi_turn.max_total_tokens,
                "data.max_prompt_length + rollout.multi_turn.max_total_tokens")
    return d.max_prompt_length + r.max_new_tokens, "data.max_prompt_length + rollout.max_new_tokens"


def _check_cp_padding(cfg: DictConfig, positions: int, problems: list[str]) -> None:
    """With context parallel each sequence is padded to a multiple of 2 x CP (its chunks), and the
    padding takes positions too: the longest sequence, padded, must stay within the model's."""
    par = cfg.actor.parallel  # the other roles' CP is the same (validate.py)
    cp = par.context_parallel
    if cp <= 1:
        return
    longest, keys = _longest_sample(cfg)
    # vLLM never generates past the model's positions (max_model_len, hpcrl.workers.actor_rollout)
    length = min(longest, positions)
    padded = cp_padded_length(length, cp)
    if padded > positions:
        room = trainer_world_size(cfg) // (par.tensor_parallel * par.pipeline_parallel)
        fits = [c for c in range(1, cp) if room % c == 0 and cp_padded_length(length, c) <= positions]
        problems.append(f"actor.parallel.context_parallel={cp}: the longest sequence ({keys} = {longest} tokens"
                        + (f", {length} within the model's positions" if longest > length else "")
                        + f") padded to a multiple of 2 x CP = {2 * cp} takes {padded} positions, past the model's "
                        f"{positions} (max_position_embeddings). Shorten it to {positions // (2 * cp) * (2 * cp)} "
                        f"tokens or fewer, or use a smaller context_parallel"
                        + (f" (the largest that fits these workers: {fits[-1]})." if fits else "."))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _layout_broken(cfg: DictConfig) -> bool:
    w = trainer_world_size(cfg)
    if w < 1:
        return True
    return any(min(p.tensor_parallel, p.pipeline_parallel, p.context_parallel) < 1
               or w % (p.tensor_parallel * p.pipeline_parallel * p.context_parallel)
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
        value = dotted_value(cfg, key)
        if value is not None and not Path(value).exists():
            problems.append(f"{key}={value!r}: does not exist.")
    for key in ("data.train_files", "data.val_files"):
        for i, f in enumerate(dotted_value(cfg, key)):
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
    else:
        _check_resume(cfg, problems)
    fn = cfg.reward.function
    if fn != "builtin" and ENTRY_POINT.match(fn):
        module = fn.split(":")[0]
        if not _importable(module):
            problems.append(f"reward.function={fn!r}: module {module!r} is not importable. Put it on "
                            "PYTHONPATH on every node.")
    if cfg.logging.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        problems.append(f"logging.wandb.mode={cfg.logging.wandb.mode!r}: wandb is not installed "
                        "(`pip install wandb`), or set logging.wandb.mode=disabled.")
    return hf


def _check_resume(cfg: DictConfig, problems: list[str]) -> None:
    """The checkpoint a run would resume from was written by a run this config can continue
    (hpcrl.checkpoint.compat): refused here, before anything starts or is written."""
    from hpcrl.checkpoint.compat import resume_problems
    from hpcrl.checkpoint.store import CheckpointStore

    how = cfg.checkpoint.resume
    if how == "never":
        return
    folder = CheckpointStore(Path(cfg.checkpoint.dir)).latest_valid() if how == "auto" else Path(how)
    if folder is not None:
        problems += resume_problems(folder, OmegaConf.to_container(cfg, resolve=True))


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
