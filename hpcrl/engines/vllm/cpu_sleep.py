"""vLLM's memory handed back while the trainer runs, on CPU: what sleep mode does on GPU.

vLLM has no sleep mode on CPU (its CPU worker ignores `sleep`), so a colocated worker held the
engine's KV cache and its weights through every update, next to the trainer's gradients, Adam
moments and activations. On CPU the engine's weights are worth nothing once the trainer has
stepped: every `enter_rollout` reloads all of them from the trainer (`RolloutEngine.load_weights`),
and vLLM's reload builds each layer's kernel weights anew. So `release` drops them (GPU sleep
level 1 keeps a host copy; here there is no cheaper place to keep one), and the KV cache too:

- each layer's CPU GEMM kernel object (`cpu_linear`: oneDNN's packed copy of the weight, which
  vLLM keeps instead of the weight itself) is replaced by a guard that refuses to run, which frees
  the packed copy; the reload installs a new one;
- parameters that vLLM keeps as plain tensors (embeddings, norms, biases) and the KV cache
  tensors get their storage resized to zero bytes; `wake` gives the same tensors their size back.
  The parameters' new memory holds whatever the heap hands back (the reload overwrites all of
  it); the KV cache's is zeroed, as vLLM allocates it (`zero_lazily`: without making it resident,
  so a step's resident set holds only the blocks it writes): vLLM's CPU attention reads the unwritten
  slots of a partly filled block and masks them out, which a NaN or inf left there by freed
  trainer tensors turns into NaN log-probs (seen once in CI; tests/test_rollout.py now fills
  the freed cache with NaN before every wake). The prefix cache is reset after every reload.

`wake(["weights"])` must be followed by a weight load before the next generate; a forward without
one fails with an error naming this instead of computing with freed memory. The functions run
inside vLLM's worker through `LLM.collective_rpc` (the in-process engine: no copy of the model).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import torch


def _released_linear(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("vLLM's weights were released for training (hpcrl.engines.vllm.cpu_sleep): "
                       "load weights (RolloutEngine.load_weights) before generating")


def _refuse_forward(module: torch.nn.Module, args: Any) -> None:
    _released_linear()


def _storages(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """One (tensor, bytes) per distinct resizable storage with bytes in it (tied weights and KV
    views share one)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen or not st.resizable():
            continue
        seen.add(st.data_ptr())
        out.append((t, st.nbytes()))
    return out


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux: private anonymous pages read back as zeros, mapped again on first touch


def zero_lazily(storage: torch.UntypedStorage) -> None:
    """Zero a storage without touching its pages: the page-aligned inside is handed back to the
    kernel (madvise MADV_DONTNEED: it reads as zeros and takes memory again only where written), the
    partial pages at the ends are zeroed by hand. Why: filling the whole KV cache made every page of
    it resident at every wake, while a step writes only the blocks its sequences use."""
    start, n = storage.data_ptr(), storage.nbytes()
    inner = -(-start // _PAGE) * _PAGE
    end = (start + n) // _PAGE * _PAGE
    if end - inner < _PAGE or _madvise(inner, end - inner, _MADV_DONTNEED) != 0:
        storage.fill_(0)
        return
    flat = torch.tensor([], dtype=torch.uint8).set_(storage)
    flat[:inner - start].zero_()
    flat[end - start:].zero_()


_libc: ctypes.CDLL | None = None


def _madvise(addr: int, length: int, advice: int) -> int:
    global _libc
    if _libc is None:  # once per process: a wake makes one call per layer
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return int(_libc.madvise(addr, length, advice))


def release(worker: Any) -> dict[str, int]:
    """Free the engine's weights and KV cache (see the module docstring); the bytes of tensors
    freed by kind (the packed kernel weights are freed too, and not counted)."""
    runner = worker.model_runner
    model = runner.get_model()
    state = runner.__dict__.setdefault("_hpcrl_released", {})
    if "weights" in state or "kv_cache" in state:
        return {"weights": 0, "kv_cache": 0}  # already released
    for m in model.modules():
        if callable(getattr(m, "cpu_linear", None)):
            m.cpu_linear = _released_linear
    weights = _storages([p for p in model.parameters()])
    kv = _storages([t for t in runner.kv_caches if torch.is_tensor(t)])
    for t, _ in weights + kv:
        t.untyped_storage().resize_(0)
    # a forward now would read freed embeddings before it reached a guarded layer: refuse it
    state["hook"] = model.register_forward_pre_hook(_refuse_forward)
    state["weights"], state["kv_cache"] = weights, kv
    return {"weights": sum(n for _, n in weights), "kv_cache": sum(n for _, n in kv)}


def wake(worker: Any, tags: list[str] | None = None) -> None:
    """Give back the sizes `release` took (tags: "weights", "kv_cache"; None: both)."""
    state = worker.model_runner.__dict__.get("_hpcrl_released", {})
    for tag in tags or ["weights", "kv_cache"]:
        for t, n in state.pop(tag, []):
            storage = t.untyped_storage()
            storage.resize_(n)
            if tag == "kv_cache":
                zero_lazily(storage)
        if tag == "weights" and "hook" in state:
            state.pop("hook").remove()  # the layers' guards stay until the reload replaces them
