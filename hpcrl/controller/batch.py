"""Batch: named tensors plus per-sample non-tensor fields sharing one leading batch dimension.

Why a container of our own: DP dispatch has to cut every field of a rollout batch
consistently (token ids, masks, prompts as strings, rewards) and glue the results back in
the original order; the wire codec then moves the tensor fields as raw buffers. It holds
no algorithm knowledge.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

NonTensor = list | np.ndarray


def even_sizes(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous pieces of `total` rows, differing by at most one."""
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _field_len(value: torch.Tensor | NonTensor) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError("a Batch tensor needs a batch dimension (got a 0-d tensor)")
        return int(value.shape[0])
    return len(value)


def _take(value: torch.Tensor | NonTensor, index: torch.Tensor) -> torch.Tensor | NonTensor:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, np.ndarray):
        return value[index.numpy()]
    return [value[i] for i in index.tolist()]


# Buffers the runtime allocated to receive DP shards side by side (see gather.py). Only these
# may be "concatenated" by returning the whole buffer: a user's own tensor must never be
# aliased by a concat result.
_JOINABLE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def mark_joinable(buf: torch.Tensor | np.ndarray) -> None:
    _JOINABLE[id(buf)] = buf


def _whole(parts: Sequence[Any]) -> Any | None:
    """The runtime buffer that `parts` are consecutive dim-0 slices of, covering all of it; else None."""
    first = parts[0]
    base = getattr(first, "_base", None) if isinstance(first, torch.Tensor) else getattr(first, "base", None)
    if base is None or _JOINABLE.get(id(base)) is not base:
        return None
    if isinstance(first, torch.Tensor):
        if not base.is_contiguous() or base.shape[1:] != first.shape[1:]:
            return None
        if any(p._base is not base for p in parts):
            return None
        nbytes = lambda t: t.numel() * t.element_size()
        ptr = base.data_ptr()
        for p in parts:
            if p.data_ptr() != ptr or not p.is_contiguous():
                return None
            ptr += nbytes(p)
        return base if ptr == base.data_ptr() + nbytes(base) else None
    if isinstance(first, np.ndarray):
        if not isinstance(base, np.ndarray) or any(p.base is not base for p in parts):
            return None
        if not base.flags.c_contiguous or base.shape[1:] != first.shape[1:]:
            return None
        ptr = base.ctypes.data
        for p in parts:
            if p.ctypes.data != ptr or not p.flags.c_contiguous:
                return None
            ptr += p.nbytes
        return base if ptr == base.ctypes.data + base.nbytes else None
    return None


def concat_rows(parts: Sequence[Any]) -> Any:
    """Concatenate tensors (or arrays) along dim 0, without a copy when they were received merged."""
    whole = _whole(parts)
    if whole is not None:
        _JOINABLE.pop(id(whole), None)  # hand it out once: later concats of its slices copy
        return whole
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return np.concatenate(parts)


class Batch:
    """Named tensors (`tensors`), per-sample Python/numpy fields (`non_tensors`) and batch-wide `meta`.

    Every tensor and non-tensor field has the same length along dim 0. `meta` holds
    plain values that describe the whole batch (e.g. a temperature) and travels pickled.
    """

    __slots__ = ("tensors", "non_tensors", "meta")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, NonTensor] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, NonTensor] = {
            k: (v if isinstance(v, np.ndarray) else list(v)) for k, v in (non_tensors or {}).items()
        }
        self.meta: dict[str, Any] = dict(meta or {})
        overlap = set(self.tensors) & set(self.non_tensors)
        if overlap:
            raise ValueError(f"fields both tensor and non-tensor: {sorted(overlap)}")
        self._check_sizes()

    def _check_sizes(self) -> None:
        sizes = {k: _field_len(v) for k, v in self._fields()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def _fields(self) -> Iterator[tuple[str, torch.Tensor | NonTensor]]:
        yield from self.tensors.items()
        yield from self.non_tensors.items()

    def __len__(self) -> int:
        for _, v in self._fields():
            return _field_len(v)
        return 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        return [k for k, _ in self._fields()]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: Any) -> Any:
        """`batch["name"]` gives a field; any other key (int, slice, index) gives a sub-batch."""
        if isinstance(key, str):
            return self.tensors[key] if key in self.tensors else self.non_tensors[key]
        if isinstance(key, slice):
            return self._map(lambda v: v[key])
        if isinstance(key, int):
            key = [key]
        return self.select(key)

    def __setitem__(self, key: str, value: torch.Tensor | NonTensor) -> None:
        if self.keys() and _field_len(value) != len(self):
            raise ValueError(f"field {key!r} has {_field_len(value)} rows, the batch {len(self)}")
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value if isinstance(value, np.ndarray) else list(value)

    def _map(self, fn: Any) -> Batch:
        return Batch(
            {k: fn(v) for k, v in self.tensors.items()},
            {k: fn(v) for k, v in self.non_tensors.items()},
            self.meta,
        )

    def select(self, index: Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """Rows in the order given: used to reorder (e.g. balance lengths) and to undo it."""
        idx = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index)
        idx = idx.to(torch.long).reshape(-1)
        return self._map(lambda v: _take(v, idx))

    reorder = select

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Contiguous pieces with the given row counts (they must add up to the batch size)."""
        if sum(sizes) != len(self):
            raise ValueError(f"split sizes {list(sizes)} do not add up to {len(self)} rows")
        out, start = [], 0
        for n in sizes:
            out.append(self[start : start + n])
            start += n
        return out

    def chunk(self, parts: int) -> list[Batch]:
        """`parts` contiguous pieces whose sizes differ by at most one (views, no copy)."""
        return self.split(even_sizes(len(self), parts))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Inverse of `split`/`chunk`; keeps the first batch's meta."""
        if not batches:
            raise ValueError("concat of no batches")
        first = batches[0]
        keys = first.keys()
        for b in batches[1:]:
            if b.keys() != keys:
                raise ValueError(f"concat of batches with different fields: {keys} vs {b.keys()}")
        tensors = {k: concat_rows([b.tensors[k] for b in batches]) for k in first.tensors}
        non_tensors: dict[str, NonTensor] = {}
        for k, v in first.non_tensors.items():
            if isinstance(v, np.ndarray):
                non_tensors[k] = concat_rows([b.non_tensors[k] for b in batches])
            else:
                non_tensors[k] = [x for b in batches for x in b.non_tensors[k]]
        return Batch(tensors, non_tensors, first.meta)

    def to(self, device: str | torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()]
        fields += [f"{k}: {type(v).__name__}" for k, v in self.non_tensors.items()]
        return f"Batch(size={len(self)}, {', '.join(fields)}, meta={sorted(self.meta)})"
