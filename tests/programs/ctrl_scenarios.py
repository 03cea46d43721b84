"""Controller program for tests/test_controller.py: every scenario of one 1 + 4 rank world.

Started by `launchers/hpcrl_entry.py tests/programs/ctrl_scenarios.py OUT.json`; rank 0
runs `main`, which records what it observed in OUT.json for the tests to assert on. The
worker classes live at module level because every rank imports this file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.controller import (
    Batch,
    CallTimeout,
    Collect,
    Dispatch,
    ParallelLayout,
    RemoteError,
    Worker,
    WorkerGroup,
    register,
)


class ScenarioWorker(Worker):
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.held: Batch | None = None

    def whoami(self) -> dict[str, Any]:
        return {**self.process_info(), "tag": self.tag}

    def echo_args(self, x: torch.Tensor, *, scale: float, note: str) -> tuple[int, torch.Tensor, str]:
        return self.group_rank, x * scale, note

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def tag_rows(self, batch: Batch) -> Batch:
        dp, tp, pp = self.parallel_coords()
        n = len(batch)
        batch["dp_rank"] = torch.full((n,), dp)
        batch["group_rank"] = torch.full((n,), self.group_rank)
        batch["doubled"] = batch["x"] * 2
        batch["who"] = [f"{self.group_rank}:{s}" for s in batch["text"]]
        return batch

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def per_rank(self, value: int, *, label: str) -> tuple[int, int, str]:
        return self.group_rank, value, label

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def rank0_only(self) -> int:
        return self.group_rank

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.NONE)
    def store(self, batch: Batch) -> int:
        self.held = batch
        return len(batch)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.DP)
    def fetch(self) -> Batch:
        return self.held

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def roundtrip(self, batch: Batch) -> Batch:
        return batch

    def shard_digest(self) -> str:
        return hashlib.sha256(self.held["x"].numpy().tobytes()).hexdigest()

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return time.monotonic()

    def spin(self, seconds: float) -> int:
        """Pure-Python busy loop: holds the GIL between switch intervals, like a hot loop."""
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            n += 1
        return n

    def fail_deliberately(self, message: str) -> None:
        raise ValueError(f"{message} from group rank {self.group_rank}")

    def holders(self) -> dict[str, Any]:
        return {"alive": Holder.holders_alive(), "closed": list(_holders_closed)}

    @staticmethod
    def frozen_objects() -> int:
        import gc

        return gc.get_freeze_count()

    def gloo_sum(self) -> dict[str, Any]:
        x = torch.tensor([float(self.worker_rank)])
        dist.all_reduce(x)
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        return {"sum": x.item(), "backend": dist.get_backend(), "env": {k: os.environ.get(k) for k in keys}}


# weak references to every Holder this process built, and the names of those closed
_holders: list[Any] = []
_holders_closed: list[str] = []


class Holder(Worker):
    """Holds 8 MB; a dropped group must free it, not just close it."""

    def __init__(self) -> None:
        self.payload = torch.zeros(2 * 1024 * 1024)
        self.cycle = self  # freed only by the garbage collector, like a model's modules
        _holders.append(weakref.ref(self))

    def close(self) -> None:
        _holders_closed.append(self.group)

    @staticmethod
    def holders_alive() -> int:
        return sum(r() is not None for r in _holders)


class BrokenInit(Worker):
    def __init__(self) -> None:
        raise RuntimeError("constructor refused")


class ReversedCoords(Worker):
    """Reports a TP=2 x DP=2 layout in a non-megatron order, as a model library might."""

    def parallel_coords(self) -> tuple[int, int, int]:
        return {0: (1, 1, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (0, 0, 0)}[self.group_rank]

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def rows_seen(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x, torch.full_like(x, self.group_rank)], dim=1)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    out: dict[str, Any] = {"controller_pid": os.getpid()}
    g = WorkerGroup(ScenarioWorker, init_kwargs={"tag": "a"}, name="actor")
    out["whoami"] = g.whoami()
    out["gloo"] = g.gloo_sum()

    # ONE_TO_ALL + ALL, with tensor, keyword and plain arguments
    res = g.echo_args(torch.arange(4.0), scale=3.0, note="hi")
    out["one_to_all"] = [[r, t.tolist(), n] for r, t, n in res]

    # DP_SPLIT + DP over an uneven batch (10 rows on 4 DP ranks: 3, 3, 2, 2)
    batch = Batch({"x": torch.arange(10.0)}, {"text": [f"s{i}" for i in range(10)]}, {"temp": 0.7})
    tagged = g.tag_rows(batch)
    out["dp_split"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v)
                       for k, v in [*tagged.tensors.items(), *tagged.non_tensors.items()]}
    out["dp_split_meta"] = tagged.meta

    # Megatron layouts given by the controller: TP=2 x DP=2, and PP=2 x DP=2
    layout_groups = []
    for name, layout in (("tp2dp2", ParallelLayout.megatron(tp=2, dp=2)),
                         ("pp2dp2", ParallelLayout.megatron(pp=2, dp=2))):
        lg = WorkerGroup(ScenarioWorker, init_kwargs={"tag": name}, name=name, layout=layout)
        layout_groups.append(lg)
        t = lg.tag_rows(Batch({"x": torch.arange(6.0)}, {"text": [str(i) for i in range(6)]}))
        out[name] = {"dp_rank": t["dp_rank"].tolist(), "group_rank": t["group_rank"].tolist(),
                     "x": t["x"].tolist()}

    # Layout reported by the workers themselves
    rc = WorkerGroup(ReversedCoords, name="reversed")
    out["reported_layout"] = [list(c) for c in rc.layout.coords]
    out["reported_rows"] = rc.rows_seen(torch.arange(4.0)).tolist()

    # PER_RANK + ALL, RANK0, NONE
    out["per_rank"] = [list(r) for r in g.per_rank([10, 11, 12, 13], label=["a", "b", "c", "d"])]
    out["rank0"] = g.rank0_only()

    # 64 MB: split to 4 workers and back, bit-identical; also held on the workers and fetched
    big = torch.randint(0, 2**31 - 1, (16 * 2**20,), dtype=torch.int32)
    out["big_bytes"] = big.numel() * big.element_size()
    out["big_digest"] = digest(big)
    t0 = time.perf_counter()
    back = g.roundtrip(Batch({"x": big}))["x"]
    out["big_roundtrip_s"] = time.perf_counter() - t0
    out["big_back_digest"] = digest(back)
    out["big_back_dtype"] = str(back.dtype)
    out["store_returns"] = g.store(Batch({"x": big}))
    out["shard_digests"] = g.shard_digest()
    out["expected_shard_digests"] = [digest(s) for s in big.chunk(4)]
    out["fetch_digest"] = digest(g.fetch()["x"])

    # Colocated group: same processes, its own object
    b = WorkerGroup(ScenarioWorker, init_kwargs={"tag": "b"}, name="critic")
    out["colocated"] = b.whoami()

    # Closing a group drops its objects on their ranks (close() first) and frees them; later calls
    # are refused on the controller; the name can be used again
    held = WorkerGroup(Holder, ranks=[1, 2], name="held")
    out["holders_before_close"] = g.holders()
    held.close()
    out["holders_after_close"] = g.holders()
    try:
        held.process_info()
        out["call_after_close"] = None
    except RuntimeError as e:
        out["call_after_close"] = str(e)
    held_again = WorkerGroup(Holder, ranks=[1], name="held")
    out["same_name_again"] = [w["group"] for w in held_again.process_info()]

    # Futures: two groups on disjoint ranks overlap
    left = WorkerGroup(ScenarioWorker, ranks=[1, 2], init_kwargs={"tag": "left"}, name="left")
    right = WorkerGroup(ScenarioWorker, ranks=[3, 4], init_kwargs={"tag": "right"}, name="right")
    t0 = time.monotonic()
    f1 = left.nap.future(1.0)
    f2 = right.nap(1.0, blocking=False)
    out["future_done_early"] = f1.done()
    f1.result()
    f2.result()
    out["overlap_elapsed_s"] = time.monotonic() - t0
    try:
        left.nap.future(1.0).result(timeout=0.05)
        out["timeout"] = "no timeout"
    except CallTimeout as e:
        out["timeout"] = str(e)
    out["after_timeout"] = left.rank0_only()

    # Remote exceptions: a method, then a constructor; the group keeps working afterwards
    try:
        g.fail_deliberately("kaboom")
        out["remote_error"] = None
    except RemoteError as e:
        out["remote_error"] = {"message": str(e), "rank": e.rank, "host": e.host,
                               "traceback": e.remote_traceback}
    out["after_error"] = g.rank0_only()
    try:
        WorkerGroup(BrokenInit, name="broken")
        out["init_error"] = None
    except RemoteError as e:
        out["init_error"] = str(e)

    # A long computation (longer than the heartbeat bound) is not a death
    bound = float(os.environ["HPCRL_HEARTBEAT_TIMEOUT"])
    t0 = time.monotonic()
    out["long_spin_iters"] = g.spin(bound + 1.5)
    out["long_spin_s"] = time.monotonic() - t0
    out["heartbeat_timeout_s"] = bound

    # The last drop on a rank (no role left there) sets what is alive aside (hpcrl/controller/serve.py): a
    # later drop's collection walks only what was built after it, and frees it, as a model is freed
    frozen_before = g.frozen_objects()
    for group in (*layout_groups, rc, b, held_again, left, right, g):
        group.close()
    probe = WorkerGroup(ScenarioWorker, init_kwargs={"tag": "probe"}, name="probe")
    out["frozen"] = {"before": frozen_before, "after_last_drop": probe.frozen_objects()}
    later = WorkerGroup(Holder, ranks=[1, 2], name="held-after-the-freeze")
    out["holders_later"] = {"before_close": probe.holders()}
    later.close()
    out["holders_later"]["after_close"] = probe.holders()

    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
