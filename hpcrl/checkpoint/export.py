"""Offline export of a checkpoint's role as a HuggingFace folder (no MPI, no process groups).

A LoRA checkpoint holds the adapters alone: `export_hf` merges them into the base model's
weights (model.path) tensor by tensor, and `lora=True` writes them as a PEFT adapter folder
instead (hpcrl.engines.megatron.lora), which `PeftModel.from_pretrained` loads onto the base.

The role's TP x PP shard files are joined unit by unit (embedding, each layer, final norm + head)
into HF tensors (`SavedRole.unit_hf`), so memory holds one output file's worth of tensors plus one
unit, whatever the model size. Config and tokenizer files come from the model folder the run was
started from (model.path of the checkpoint's config.yaml).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from hpcrl.checkpoint.files import fsync_dir, fsync_file
from hpcrl.checkpoint.megatron_state import PARAM, SEP, SavedRole


def source_model_path(ckpt: Path, saved: Any, override: str | None = None) -> Path:
    """The HF folder whose config/tokenizer files go with the export: `override`, else model.path
    of config.yaml (relative paths: from the current directory), else the absolute path the writer
    recorded at save time."""
    candidates: list[Path] = []
    if override:
        candidates.append(Path(override))
    else:
        cfg_file = ckpt / "config.yaml"
        if cfg_file.is_file():
            import yaml

            cfg = yaml.safe_load(cfg_file.read_text()) or {}
            path = (cfg.get("model") or {}).get("path")
            if path:
                candidates.append(Path(path))
        candidates.append(Path(saved["model_path"] if isinstance(saved, dict) else saved.meta0["model_path"]))
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    raise FileNotFoundError(f"no HF model folder with config.json among {[str(c) for c in candidates]}; "
                            "pass the model folder explicitly (--model-path)")


def saved_adapters(saved: SavedRole) -> dict[str, Any]:
    """PEFT-named full adapters of a LoRA checkpoint's role (its TP shards joined per stage)."""
    from hpcrl.engines.megatron.lora import adapters_to_hf

    out: dict[str, Any] = {}
    for pp in range(saved.pp):
        shards = [{n: saved.tensor(pp, tp, f"{PARAM}{SEP}{n}") for n in saved.meta(pp, tp)["params"]}
                  for tp in range(saved.tp)]
        out.update(adapters_to_hf(saved.arch, shards, pp, saved.pp))
    return out


def _lora_settings(meta: dict[str, Any]) -> Any:
    from hpcrl.engines.megatron.lora import LoraSettings

    return LoraSettings(rank=int(meta["rank"]), alpha=float(meta["alpha"]), dropout=float(meta["dropout"]),
                        targets=tuple(meta["targets"]), seed=int(meta["seed"]))


def _merged_units(saved: SavedRole, src: Path) -> Any:
    """(name, tensor) of the base model's weights with a LoRA checkpoint's adapters merged into
    the layers they adapt: W + (alpha / r) B A, computed in fp32, stored in W's dtype."""
    from hpcrl.engines.megatron.convert import SafetensorsReader
    from hpcrl.engines.megatron.lora import PEFT_PREFIX

    settings = _lora_settings(saved.meta0["lora"])
    adapters = saved_adapters(saved)
    reader = SafetensorsReader(src)
    for name in sorted(reader.keys()):
        w = reader(name)
        stem = name.removesuffix(".weight")
        a = adapters.get(f"{PEFT_PREFIX}{stem}.lora_A.weight")
        if a is not None:
            b = adapters[f"{PEFT_PREFIX}{stem}.lora_B.weight"]
            w = (w.float() + settings.scale * (b.float() @ a.float())).to(w.dtype)
        yield name, w


def _staging(out: Path) -> Path:
    """A fresh folder beside `out` to write into (`out` must not exist or be empty)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    """Make the written folder `out`, durably: it appears complete or not at all."""
    fsync_dir(tmp)
    if out.exists():
        out.rmdir()
    os.rename(tmp, out)
    fsync_dir(out.parent)


def export_peft(ckpt: str | Path, out_dir: str | Path, role: str = "actor", model_path: str | None = None
                ) -> dict[str, Any]:
    """Write the LoRA adapters of `role` as a PEFT folder (adapter_config.json names the base)."""
    from hpcrl.checkpoint.fsdp_state import is_fsdp_role, read_meta, saved_peft_adapters
    from hpcrl.engines.megatron.lora import write_peft_folder

    ckpt, out = Path(ckpt), Path(out_dir)
    fsdp = is_fsdp_role(ckpt / role)
    saved: Any = read_meta(ckpt / role) if fsdp else SavedRole(ckpt / role)
    meta = saved if fsdp else saved.meta0
    if not meta.get("lora"):
        raise ValueError(f"{ckpt / role}: no LoRA adapters in this checkpoint (actor.lora.rank was 0); "
                         "export the full weights without --lora")
    src = source_model_path(ckpt, saved, model_path)
    tmp = _staging(out)
    try:
        tensors = saved_peft_adapters(ckpt / role) if fsdp else saved_adapters(saved)
        write_peft_folder(tmp, tensors, _lora_settings(meta["lora"]), str(src.resolve()))
        for f in tmp.iterdir():
            fsync_file(f)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "files": 2, "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "model_path": str(src),
            "step_count": meta["step_count"], "layout": meta.get("layout") or {"tp": 1, "pp": 1, "dp": meta["dp"],
                                                                           "engine": "fsdp"}}


def export_hf(ckpt: str | Path, out_dir: str | Path, role: str = "actor", model_path: str | None = None,
              max_shard_bytes: int = 2 << 30) -> dict[str, Any]:
    """Write `role` of the checkpoint folder `ckpt` as a HF folder `out_dir` (which must not exist
    or be empty). The folder appears complete or not at all (written beside it, then renamed).
    A LoRA checkpoint's adapters are merged into the base model's weights."""
    from hpcrl.checkpoint.fsdp_state import is_fsdp_role

    ckpt, out = Path(ckpt), Path(out_dir)
    if is_fsdp_role(ckpt / role):
        return _export_fsdp_hf(ckpt, out, role, model_path, max_shard_bytes)
    saved = SavedRole(ckpt / role)
    if saved.value_head:
        raise ValueError(f"{role} has a value head instead of an LM head: export-hf writes LM roles (actor, reference)")
    src = source_model_path(ckpt, saved, model_path)
    tmp = _staging(out)

    def tensors() -> Any:
        if saved.meta0.get("lora"):
            yield from _merged_units(saved, src)
            return
        for pp in range(saved.pp):
            for unit in saved.units(pp):
                yield from saved.unit_hf(PARAM, pp, unit).items()

    total, parts, weight_map = _write_hf_folder(tmp, out, src, tensors(), max_shard_bytes)
    return {"out": str(out), "files": len(parts), "tensors": len(weight_map), "bytes": total,
            "model_path": str(src), "step_count": saved.meta0["step_count"], "layout": saved.meta0["layout"]}


def _export_fsdp_hf(ckpt: Path, out: Path, role: str, model_path: str | None, max_shard_bytes: int
                    ) -> dict[str, Any]:
    """export_hf of a role the FSDP engine saved (hpcrl.checkpoint.fsdp_state): DCP's shards put
    together into HF-named tensors, in the model's dtype as saved (fp32 shards); LoRA adapters merged."""
    from hpcrl.checkpoint.fsdp_state import read_meta, saved_hf_tensors

    meta = read_meta(ckpt / role)
    if meta.get("value_head"):
        raise ValueError(f"{role} has a value head instead of an LM head: export-hf writes LM roles (actor, reference)")
    src = source_model_path(ckpt, meta, model_path)
    tmp = _staging(out)
    tensors = saved_hf_tensors(ckpt / role)
    if meta.get("lora"):  # the adapters merged into the weights they adapt
        from hpcrl.engines.fsdp.lora import merged_state

        tensors = merged_state(tensors, _lora_settings(meta["lora"]).scale)
    total, parts, weight_map = _write_hf_folder(tmp, out, src, iter(tensors.items()), max_shard_bytes)
    return {"out": str(out), "files": len(parts), "tensors": len(weight_map), "bytes": total, "model_path": str(src),
            "step_count": meta["step_count"], "layout": {"tp": 1, "pp": 1, "dp": meta["dp"], "engine": "fsdp"}}


def _write_hf_folder(tmp: Path, out: Path, src: Path, tensors: Any, max_shard_bytes: int
                     ) -> tuple[int, list[list[str]], dict[str, str]]:
    """Write (name, tensor) pairs as safetensors parts of at most ~max_shard_bytes into `tmp`, with the
    index and the source folder's other files, then publish `tmp` as `out`."""
    from safetensors.torch import save_file

    parts: list[list[str]] = []
    bucket: dict[str, Any] = {}
    size = 0
    total = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            path = tmp / f"part-{len(parts)}.safetensors"
            save_file(bucket, str(path), metadata={"format": "pt"})
            fsync_file(path)
            parts.append(sorted(bucket))
        bucket, size = {}, 0

    try:
        for name, t in tensors:
            bucket[name] = t.clone()  # split q/k/v may share storage; safetensors refuses that
            n = t.numel() * t.element_size()
            size += n
            total += n
            if size >= max_shard_bytes:
                flush()
        flush()
        weight_map = {}
        for i, names in enumerate(parts):
            final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            os.rename(tmp / f"part-{i}.safetensors", tmp / final)
            weight_map.update({k: final for k in names})
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return total, parts, weight_map
