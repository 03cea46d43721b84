"""Dispatch modes (how a call's arguments reach the ranks of a group) and collect modes
(how their results come back), declared on worker methods with `@register`.

Why declared on the method: the algorithm on the controller should read
`out = actor.compute_logprob(batch)` and not care that the batch was cut into DP shards,
sent to every TP/PP rank of each shard, and glued back from the ranks that hold the output
(TP rank 0 of the last pipeline stage).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from hpcrl.controller.batch import Batch, concat_rows, even_sizes


class Dispatch(enum.Enum):
    """How arguments are distributed over the ranks of a group."""

    ONE_TO_ALL = "one_to_all"  # every rank gets the same arguments
    DP_SPLIT = "dp_split"  # Batch/tensor/array arguments cut into DP shards; a rank gets its dp_rank's shard
    PER_RANK = "per_rank"  # every argument is a sequence with one element per group rank


class Collect(enum.Enum):
    """Which ranks send results back and how they are combined on the controller."""

    ALL = "all"  # list of every rank's result, in group-rank order (gather-all)
    RANK0 = "rank0"  # the result of group rank 0 only
    DP = "dp"  # results of TP rank 0 on the last PP stage, in dp_rank order, concatenated
    NONE = "none"  # nothing but completion (and errors) comes back


@dataclass(frozen=True)
class MethodMode:
    dispatch: Dispatch
    collect: Collect


DEFAULT_MODE = MethodMode(Dispatch.ONE_TO_ALL, Collect.ALL)
_MODE_ATTR = "__hpcrl_mode__"
F = TypeVar("F", bound=Callable[..., Any])


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL, collect: Collect = Collect.ALL) -> Callable[[F], F]:
    """Declare how a worker method is called from the controller.

    Undecorated public methods are callable too, with ONE_TO_ALL / ALL.
    """

    def mark(fn: F) -> F:
        setattr(fn, _MODE_ATTR, MethodMode(Dispatch(dispatch), Collect(collect)))
        return fn

    return mark


def method_mode(cls: type, name: str) -> MethodMode:
    fn = getattr(cls, name, None)
    if fn is None or not callable(fn) or name.startswith("_"):
        raise AttributeError(f"{cls.__name__} has no public method {name!r}")
    return getattr(fn, _MODE_ATTR, DEFAULT_MODE)


@dataclass(frozen=True)
class ParallelLayout:
    """(dp_rank, tp_rank, pp_rank) of each group rank.

    Convention: `megatron(tp, pp, dp)` follows megatron-core's default order "tp-cp-ep-dp-pp"
    with cp = ep = 1, i.e. group rank = tp + TP * (dp + DP * pp): TP fastest, PP slowest.
    Workers with context or expert parallelism report their own coordinates instead, and
    must report tp_rank 0 on exactly one rank per (dp_rank, pp_rank) — the one whose
    result is collected (e.g. tp_rank = tp + TP * cp).
    """

    coords: tuple[tuple[int, int, int], ...]

    @classmethod
    def megatron(cls, tp: int = 1, pp: int = 1, dp: int = 1) -> ParallelLayout:
        coords = []
        for rank in range(tp * pp * dp):
            t, rest = rank % tp, rank // tp
            d, p = rest % dp, rest // dp
            coords.append((d, t, p))
        return cls(tuple(coords))

    @classmethod
    def data_parallel(cls, size: int) -> ParallelLayout:
        return cls.megatron(dp=size)

    def __post_init__(self) -> None:
        seen = set(self.coords)
        if len(seen) != len(self.coords):
            raise ValueError(f"duplicate parallel coordinates in {self.coords}")
        expected = {(d, t, p) for d in range(self.dp_size) for t in range(self.tp_size) for p in range(self.pp_size)}
        if seen != expected:
            raise ValueError(f"coordinates {sorted(seen)} do not form a full dp x tp x pp grid")

    @property
    def size(self) -> int:
        return len(self.coords)

    @property
    def dp_size(self) -> int:
        return 1 + max(c[0] for c in self.coords)

    @property
    def tp_size(self) -> int:
        return 1 + max(c[1] for c in self.coords)

    @property
    def pp_size(self) -> int:
        return 1 + max(c[2] for c in self.coords)

    def dp_rank(self, group_rank: int) -> int:
        return self.coords[group_rank][0]

    def output_ranks(self) -> list[int]:
        """Group ranks whose results form the output (TP rank 0, last PP stage), by dp_rank."""
        last = self.pp_size - 1
        ranks = [r for r, (_, t, p) in enumerate(self.coords) if t == 0 and p == last]
        return sorted(ranks, key=self.dp_rank)


def _splittable(x: Any) -> bool:
    return isinstance(x, Batch) or (isinstance(x, torch.Tensor | np.ndarray) and x.ndim >= 1)


def _shards(x: Any, parts: int) -> list[Any]:
    if isinstance(x, Batch):
        return x.chunk(parts)
    if not _splittable(x):
        return [x] * parts
    sizes = even_sizes(len(x), parts)
    if isinstance(x, torch.Tensor):
        return list(torch.split(x, sizes))
    return np.split(x, np.cumsum(sizes)[:-1])


def dp_split(args: tuple, kwargs: dict, dp_size: int) -> list[tuple[tuple, dict]]:
    """(args, kwargs) for each dp_rank: Batch, tensor and array arguments are sharded, the rest repeated."""
    arg_shards = [_shards(a, dp_size) for a in args]
    kw_shards = {k: _shards(v, dp_size) for k, v in kwargs.items()}
    return [
        (tuple(s[d] for s in arg_shards), {k: s[d] for k, s in kw_shards.items()})
        for d in range(dp_size)
    ]


def per_rank_split(args: tuple, kwargs: dict, size: int) -> list[tuple[tuple, dict]]:
    """(args, kwargs) for each group rank from arguments that hold one element per rank."""
    for name, v in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(v, Sequence | torch.Tensor | np.ndarray) or len(v) != size:
            raise ValueError(f"PER_RANK dispatch needs {name} to have one element per rank ({size})")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(size)]


def merge(values: list[Any]) -> Any:
    """Concatenate DP results in order: Batches, tensors and arrays join along dim 0; tuples
    merge element-wise; None stays None; anything else becomes a list."""
    first = values[0]
    if all(isinstance(v, Batch) for v in values):
        return Batch.concat(values)
    if all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in values):
        return concat_rows(values)
    if all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values):
        return concat_rows(values)
    if all(v is None for v in values):
        return None
    if isinstance(first, tuple) and all(isinstance(v, tuple) and len(v) == len(first) for v in values):
        return tuple(merge([v[i] for v in values]) for i in range(len(first)))
    return list(values)
