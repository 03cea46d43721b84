"""WorkerGroup: the controller's proxy for one role running SPMD on a set of worker ranks.

Why a proxy: the RL algorithm is one plain program on rank 0, and `actor.update(batch)`
should read like a local call while it actually shards the batch over the DP replicas,
runs the method on every rank of the group, and collects the output ranks' results.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hpcrl.controller.codec import Encoded, encode
from hpcrl.controller.dispatch import (
    Collect,
    Dispatch,
    MethodMode,
    ParallelLayout,
    dp_split,
    merge,
    method_mode,
    per_rank_split,
)
from hpcrl.controller.runtime import Future, get_runtime
from hpcrl.controller.worker import Worker

_names = itertools.count()


class BoundMethod:
    """`group.method(...)` blocks and returns the collected result; `.future(...)` does not block."""

    def __init__(self, group: WorkerGroup, name: str, mode: MethodMode) -> None:
        self._group = group
        self._name = name
        self.mode = mode

    def __call__(self, *args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        fut = self._group.submit(self._name, args, kwargs, self.mode)
        return fut.result() if blocking else fut

    def future(self, *args: Any, **kwargs: Any) -> Future:
        return self._group.submit(self._name, args, kwargs, self.mode)


class WorkerGroup:
    """Instances of `cls` on MPI ranks `ranks` (default: every worker), one per rank.

    Construction blocks until every rank built its object (a constructor's exception is
    raised here as a RemoteError). Groups may share ranks: each process then hosts one
    object per group, addressed by `name`. `layout` gives the (dp, tp, pp) coordinates
    used by DP dispatch; without it they are asked from the objects' `parallel_coords()`
    on first use (and again after `refresh_layout()`).
    """

    def __init__(
        self,
        cls: type[Worker],
        ranks: Sequence[int] | None = None,
        init_args: Sequence[Any] = (),
        init_kwargs: dict[str, Any] | None = None,
        name: str | None = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"{cls!r} is not a subclass of hpcrl.controller.Worker")
        rt = get_runtime()
        self.cls = cls
        self.ranks = list(ranks) if ranks is not None else list(range(1, rt.world.size))
        bad = [r for r in self.ranks if not 1 <= r < rt.world.size]
        if bad or len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"worker ranks must be distinct and within 1..{rt.world.size - 1}: {self.ranks}")
        self.name = name or f"{cls.__name__}-{next(_names)}"
        if layout is not None and layout.size != len(self.ranks):
            raise ValueError(f"layout has {layout.size} ranks, the group {len(self.ranks)}")
        self._layout = layout
        self._methods: dict[str, BoundMethod] = {}
        self._closed = False
        enc = encode((tuple(init_args), dict(init_kwargs or {})))
        base = {"k": "create", "obj": self.name, "cls": (cls.__module__, cls.__qualname__),
                "group_size": len(self.ranks)}
        messages = {
            r: ({**base, "group_rank": i, "coords": layout.coords[i] if layout else None}, enc)
            for i, r in enumerate(self.ranks)
        }
        rt.submit(f"{self.name}.__init__", messages, lambda results: None).result()

    def close(self) -> None:
        """Drop the group's objects on their ranks (each object's `close()` runs first), freeing
        what they hold: models, optimizer state, process groups. Calls after this are refused."""
        if self._closed:
            return
        messages = {r: ({"k": "drop", "obj": self.name}, encode(((), {}))) for r in self.ranks}
        get_runtime().submit(f"{self.name}.close", messages, lambda results: None).result()
        self._closed = True
        self._methods.clear()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            coords = self.submit("parallel_coords", (), {}, MethodMode(Dispatch.ONE_TO_ALL, Collect.ALL))
            self._layout = ParallelLayout(tuple(tuple(c) for c in coords.result()))
        return self._layout

    def refresh_layout(self) -> ParallelLayout:
        """Forget the cached layout (e.g. after the workers re-initialised model parallelism)."""
        self._layout = None
        return self.layout

    def __getattr__(self, name: str) -> BoundMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        methods = self.__dict__.get("_methods")
        if methods is None:
            raise AttributeError(name)
        if name not in methods:
            methods[name] = BoundMethod(self, name, method_mode(self.cls, name))
        return methods[name]

    def call(self, method: str, *args: Any, dispatch: Dispatch | None = None, collect: Collect | None = None,
             blocking: bool = True, **kwargs: Any) -> Any:
        """Call `method` with an explicit mode (overrides the one registered on the method)."""
        mode = method_mode(self.cls, method)
        mode = MethodMode(dispatch or mode.dispatch, collect or mode.collect)
        fut = self.submit(method, args, kwargs, mode)
        return fut.result() if blocking else fut

    def submit(self, method: str, args: tuple, kwargs: dict, mode: MethodMode) -> Future:
        """Dispatch one call according to `mode`; the building block of the proxies above."""
        if self._closed:
            raise RuntimeError(f"{self!r} was closed: its objects no longer exist on the workers")
        rt = get_runtime()
        rt.faults.maybe_kill_self(method)
        n = len(self.ranks)
        wanted = self._wanted_ranks(mode.collect)
        header = {"k": "call", "obj": self.name, "m": method}
        headers = {True: {**header, "want": True}, False: {**header, "want": False}}
        if mode.dispatch is Dispatch.ONE_TO_ALL:
            enc = encode((args, kwargs))
            payloads: list[Encoded] = [enc] * n
        elif mode.dispatch is Dispatch.DP_SPLIT:
            layout = self.layout
            shards = [encode(s) for s in dp_split(args, kwargs, layout.dp_size)]
            payloads = [shards[layout.dp_rank(r)] for r in range(n)]
        else:
            payloads = [encode(s) for s in per_rank_split(args, kwargs, n)]
        messages = {self.ranks[r]: (headers[r in wanted], payloads[r]) for r in range(n)}
        merged = None
        if mode.collect is Collect.DP:
            merged = [self.ranks[g] for g in self.layout.output_ranks()]
        return rt.submit(f"{self.name}.{method}", messages, self._combiner(mode.collect), merged)

    def _wanted_ranks(self, collect: Collect) -> set[int]:
        if collect is Collect.ALL:
            return set(range(len(self.ranks)))
        if collect is Collect.RANK0:
            return {0}
        if collect is Collect.DP:
            return set(self.layout.output_ranks())
        return set()

    def _combiner(self, collect: Collect) -> Any:
        mpi_of = self.ranks
        if collect is Collect.ALL:
            return lambda res: [res[r] for r in mpi_of]
        if collect is Collect.RANK0:
            return lambda res: res[mpi_of[0]]
        if collect is Collect.DP:
            order = [mpi_of[g] for g in self.layout.output_ranks()]
            return lambda res: merge([res[r] for r in order])
        return lambda res: None

    def __repr__(self) -> str:
        return f"WorkerGroup({self.cls.__name__}, name={self.name!r}, ranks={self.ranks})"
