"""Checkpoints of the FSDP engine (hpcrl.engines.fsdp) with torch.distributed.checkpoint (DCP).

`<ckpt>/<role>/` holds DCP's files (`*.distcp`, each rank's shards of the weights and of the AdamW
state, and `.metadata`, the global layout) and `fsdp.json` (engine, architecture, optimizer step,
saved DP size). Every rank writes its own shards; DCP reshards on load, so a checkpoint saved at one
DP size loads at another. At the same DP size the shards come back byte for byte and the RNG states
are restored (`rng/rank<r>.pt`, as for the Megatron engine); at another they are reseeded from
(trainer.seed, optimizer step, rank). The records of the role's files go into the manifest as for the
Megatron engine (hpcrl.checkpoint.store), from the group's first rank once DCP's save has finished.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hpcrl.checkpoint.files import FileRecord, file_record, write_durable
from hpcrl.checkpoint.megatron_state import FILE_SLACK, _config_seed, _rng_written
from hpcrl.checkpoint.rng import capture_rng, restore_or_reseed, rng_blob, write_rng

META = "fsdp.json"


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _lora_meta(engine: Any) -> dict[str, Any] | None:
    """The LoRA settings of an FSDP actor (what `hpcrl ckpt export-hf --lora` writes into the PEFT config)."""
    lora = getattr(engine, "lora", None)
    return None if lora is None else {**asdict(lora.settings), "targets": list(lora.settings.targets)}


class FsdpCheckpointer:
    """Save and load of one role's FSDP engine on one rank (a collective over the engine's group).
    async_save is written before `save` returns too (DCP's own async save needs a second process
    group); its records come from `wait`, as the controller collects them for an async save."""

    def __init__(self, engine: Any, role: str, model_path: str) -> None:
        self.engine = engine
        self.role = role
        self.model_path = model_path
        self._records: list[FileRecord] = []

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        e = self.engine
        state: dict[str, Any] = {"model": get_model_state_dict(e.model)}
        if e.optimizer is not None:
            state["optim"] = get_optimizer_state_dict(e.model, e.optimizer)
        return state

    def nbytes(self) -> int:
        """~Bytes this rank's next save writes: its shards of the weights and optimizer state, its RNG file."""
        import torch.distributed as dist

        e = self.engine
        n = sum(_local_bytes(p) for p in e.model.parameters())
        if e.optimizer is not None:
            n += sum(_local_bytes(v) for st in e.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
        return n + len(rng_blob(dist.get_rank(), dist.get_world_size(), capture_rng())) + FILE_SLACK

    def save(self, ckpt_dir: str, async_save: bool = False) -> list[FileRecord]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        e = self.engine
        root = Path(ckpt_dir)
        role_dir = root / self.role
        role_dir.mkdir(parents=True, exist_ok=True)
        dcp.save(self._state(), storage_writer=dcp.FileSystemWriter(str(role_dir), sync_files=True),
                 process_group=e.group)
        records: list[FileRecord] = []
        if e.dp_rank == 0:
            meta = {"engine": "fsdp", "arch": asdict(e.arch), "model_path": str(Path(self.model_path).resolve()),
                    "value_head": bool(e.value_head), "step_count": e.step_count,
                    "nonfinite_in_a_row": e.nonfinite_in_a_row, "dp": e.dp_size, "lora": _lora_meta(e)}
            write_durable(role_dir / META, json.dumps(meta, indent=1))
            records += [file_record(f, root) for f in sorted(role_dir.iterdir()) if f.is_file()]
        key = str(root.resolve())
        if key not in _rng_written:
            _rng_written.add(key)
            records += write_rng(root, dist.get_rank(), dist.get_world_size(), capture_rng())
        if async_save:
            self._records = records
            return []
        return records

    def wait(self) -> list[FileRecord]:
        """The records of the last async save (written already); [] when there is none."""
        records, self._records = self._records, []
        return records

    def load(self, ckpt_dir: str, seed: int | None = None) -> dict[str, Any]:
        """Load the role's saved weights and optimizer state (resharded by DCP when the DP size differs),
        the optimizer step, and the RNG states (restored at the same DP size and world, else reseeded)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        t0 = time.monotonic()
        e = self.engine
        root = Path(ckpt_dir)
        role_dir = root / self.role
        meta_file = role_dir / META
        if not meta_file.is_file():
            raise ValueError(f"{role_dir}: no {META}; this role was not saved by the FSDP engine (actor.engine="
                             "megatron checkpoints load on the Megatron engine)")
        meta = json.loads(meta_file.read_text())
        if meta["arch"] != asdict(e.arch):
            diff = {k: (meta["arch"].get(k), v) for k, v in asdict(e.arch).items() if meta["arch"].get(k) != v}
            raise ValueError(f"{role_dir}: saved from another model (saved vs current: {diff})")
        if meta.get("lora") != _lora_meta(e):
            raise ValueError(f"{role_dir}: saved with actor.lora {meta.get('lora') or 'off'}, this run has "
                             f"{_lora_meta(e) or 'off'}; resume with the LoRA settings it was saved with")
        state = self._state()  # (torch creates AdamW's moments first: DCP loads into existing tensors)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(role_dir)), process_group=e.group)
        set_model_state_dict(e.model, state["model"])
        if e.optimizer is not None:
            set_optimizer_state_dict(e.model, e.optimizer, state["optim"])
        e.step_count = int(meta["step_count"])
        e.nonfinite_in_a_row = int(meta.get("nonfinite_in_a_row", 0))
        rank, world = dist.get_rank(), dist.get_world_size()
        seed = _config_seed(root) if seed is None else seed
        rng = restore_or_reseed(root, rank, world, meta["dp"] == e.dp_size, seed, e.step_count)
        return {"role": self.role, "engine": "fsdp", "step_count": e.step_count, "converted": meta["dp"] != e.dp_size,
                "rng": rng, "saved_layout": {"tp": 1, "pp": 1, "dp": meta["dp"], "cp": 1},
                "layout": {"tp": 1, "pp": 1, "dp": e.dp_size, "cp": 1}, "seconds": round(time.monotonic() - t0, 3)}


def is_fsdp_role(role_dir: str | Path) -> bool:
    """Whether a checkpoint's role folder was written by the FSDP engine."""
    return (Path(role_dir) / META).is_file()


def read_meta(role_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(role_dir) / META).read_text())


def saved_hf_tensors(role_dir: str | Path) -> dict[str, torch.Tensor]:
    """The saved weights as full HF-named tensors, read in this process alone (no process group): DCP
    puts each rank's shards together. For `hpcrl ckpt export-hf` and checks."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys({"model"}, checkpoint_id=str(role_dir))
    return {k.removeprefix("hf."): v for k, v in state["model"].items()}


def saved_peft_adapters(role_dir: str | Path) -> dict[str, torch.Tensor]:
    """The saved LoRA adapters, full and PEFT-named (hpcrl.engines.fsdp.lora)."""
    from hpcrl.engines.fsdp.lora import is_adapter, peft_name

    return {peft_name(k): v for k, v in saved_hf_tensors(role_dir).items() if is_adapter(k)}
