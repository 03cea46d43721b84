"""RNG streams in a checkpoint: every rank's Python, NumPy, torch (CPU and CUDA) and megatron tracker
states, saved as rng/rank{R}.pt and restored at a resume into the same layout; after a layout change,
where saved per-rank streams mean nothing, fresh streams seeded from (seed, step, rank).

`hpcrl.checkpoint.megatron_state.RoleCheckpointer` writes and reads them beside each rank's shard.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import random
from pathlib import Path
from typing import Any

import torch

from hpcrl.checkpoint.files import FileRecord, file_record, fsync_dir, is_no_space, write_durable
from hpcrl.checkpoint.store import CheckpointError, no_space_error


def capture_rng() -> dict[str, Any]:
    """Every RNG this process draws from: Python, NumPy, torch CPU, CUDA devices, and megatron's
    tensor-parallel tracker (on CPU its states are CPU generator states, see cpu_compat)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        s = np.random.get_state(legacy=False)
        key = torch.from_numpy(s["state"]["key"].astype("int64"))
        state["numpy"] = {"bit_generator": s["bit_generator"], "key": key, "pos": int(s["state"]["pos"]),
                          "has_gauss": int(s["has_gauss"]), "gauss": float(s["gauss"])}
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["megatron_tracker"] = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        s = state["numpy"]
        np.random.set_state({"bit_generator": s["bit_generator"], "state": {"key": s["key"].numpy().astype(np.uint32),
                             "pos": s["pos"]}, "has_gauss": s["has_gauss"], "gauss": s["gauss"]})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("megatron_tracker"):
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["megatron_tracker"].items()})


def rank_seed(seed: int, step: int, rank: int) -> int:
    """A per-rank seed that depends on (seed, step, rank) only (stable across Python versions)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:4], "little")


def read_rng_file(path: Path) -> dict[str, Any]:
    """A rank's saved RNG streams. Tensors and plain containers only: a checkpoint may come from
    anywhere (a shared folder, a download), and a pickle can run any code when it is loaded."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused to load, it holds more than tensors and plain containers "
                              f"(code or objects that loading would run): {e}") from None


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Deterministic fresh RNG streams after a layout change, where saved per-rank streams have no
    meaning: Python and NumPy from (seed, step, rank); torch and megatron's tracker as a fresh
    start with seed + step does it (the same on all ranks, the tracker offset per TP rank). Without
    megatron's parallel state (every role on the FSDP engine) there is no tracker to seed."""
    from megatron.core import parallel_state, tensor_parallel

    r = rank_seed(seed, step, rank)
    random.seed(r)
    try:
        import numpy as np
        np.random.seed(r)
    except ImportError:
        pass
    torch.manual_seed(r)
    if parallel_state.model_parallel_is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed((seed + step) % (2**31))


def restore_or_reseed(ckpt_dir: Path, rank: int, world_size: int, same_layout: bool, seed: int, step: int) -> str:
    """A resume's RNG streams: this rank's saved ones at the layout and world size they were saved
    at, else fresh ones from (seed, step, rank). Returns "restored" or "reseeded"."""
    rng_file = Path(ckpt_dir) / "rng" / f"rank{rank}.pt"
    if same_layout and rng_file.is_file():
        blob = read_rng_file(rng_file)
        if blob["world_size"] == world_size:
            restore_rng(blob["state"])
            return "restored"
    reseed_rng(seed, step, rank)
    return "reseeded"


def rng_blob(rank: int, world_size: int, state: dict[str, Any]) -> bytes:
    """The bytes of a rank's RNG file (a few KB)."""
    buf = io.BytesIO()
    torch.save({"world_size": world_size, "rank": rank, "state": state}, buf)
    return buf.getvalue()


def write_rng(ckpt_dir: str | Path, rank: int, world_size: int, state: dict[str, Any]) -> list[FileRecord]:
    """Write and fsync rng/rank{R}.pt. Serialized in memory first: torch.save into a file that
    runs out of space fails with "unexpected pos 576 vs 534", which names neither cause nor file;
    a plain write raises ENOSPC, which becomes a DiskFullError naming both."""
    root = Path(ckpt_dir)
    d = root / "rng"
    path = d / f"rank{rank}.pt"
    blob = rng_blob(rank, world_size, state)
    try:
        d.mkdir(parents=True, exist_ok=True)
        write_durable(path, blob)
        fsync_dir(d)
    except OSError as e:
        if not is_no_space(e):
            raise
        path.unlink(missing_ok=True)
        raise no_space_error(path, f"RNG states of torch.distributed rank {rank}", len(blob)) from e
    return [file_record(path, root)]
