"""The weights to rollout pool workers: a gloo group of trainer worker 0 (rank 0) and one pool worker
(rank 1) per worker, made once through the TCPStore the controller hosts (its address in each
`weights` message) and kept while the worker lives.

Per bucket of hpcrl.engines.transfer.send_to_rollout, worker 0 sends a JSON header (names, shapes,
dtypes: a length then the bytes) and one flat buffer per dtype of whole HF tensors; the pool worker
reads them with the same receiver the split placement's engines use (`receive_from_trainer`, over a
`HeaderChannel` instead of the MPI bridge). A worker that is gone or hangs makes worker 0's send raise
(at once, or after the link's timeout, rollout.pool_liveness_s): worker 0 drops that worker and goes
on with the others.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# trainer worker 0's links, by member id
_links: dict[str, Any] = {}


def open_link(store: list[Any], key: str, rank: int, timeout_s: float) -> Any:
    """This process's end (rank 0: trainer worker 0, 1: the pool worker) of a two-rank gloo group."""
    import torch.distributed as dist

    host, port = str(store[0]), int(store[1])
    timeout = datetime.timedelta(seconds=timeout_s)
    tcp = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pool/{key}/", tcp), rank, 2, timeout)


class HeaderChannel:
    """The MPI bridge's `bcast(obj, root=0)` for headers, over a two-rank gloo group, as JSON."""

    def __init__(self, group: Any):
        self.group = group

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if self.group.rank() == root:
            data = json.dumps(obj).encode()
            self.group.broadcast(torch.tensor([len(data)], dtype=torch.int64), root).wait()
            self.group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), root).wait()
            return obj
        size = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(size, root).wait()
        buf = torch.empty(int(size), dtype=torch.uint8)
        self.group.broadcast(buf, root).wait()
        return json.loads(bytes(buf.numpy()))


class PoolSender:
    """Trainer worker 0's side of one weight load to the pool workers `targets` (the controller's
    `weights` specs): open the new links, send each bucket to every live link, note the failures."""

    def __init__(self, targets: list[dict[str, Any]]):
        self.failed: dict[str, str] = {}
        self.bytes_sent = 0
        self.links: dict[str, Any] = {}
        for t in targets:
            member = str(t["member"])
            try:
                if member not in _links:
                    _links[member] = open_link(t["store"], t["key"], 0, float(t["timeout_s"]))
                self.links[member] = _links[member]
            except Exception as e:  # noqa: BLE001 - any failure to meet the worker drops it, not the run
                self._fail(member, e)

    def _fail(self, member: str, err: BaseException) -> None:
        self.failed[member] = f"{type(err).__name__}: {err}"[:500]
        self.links.pop(member, None)
        _links.pop(member, None)
        log.warning("rollout pool worker %s dropped from the weight load: %s", member, self.failed[member])

    def send_bucket(self, hf: dict[str, torch.Tensor], aliases: list[tuple[str, str]]) -> None:
        """One bucket of HF tensors (whole: a pool worker runs rollout TP 1)."""
        if not self.links:
            return
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in hf.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        order = sorted(by_dtype.items(), key=lambda kv: str(kv[0]))
        header = {"groups": [(str(d).removeprefix("torch."), [(n, list(hf[n].shape), [None]) for n in names])
                             for d, names in order], "aliases": aliases}
        flats = [torch.cat([hf[n].detach().reshape(-1) for n in names]).cpu() for _, names in order]
        for member, link in list(self.links.items()):
            try:
                HeaderChannel(link).bcast(header)
                for flat in flats:
                    link.broadcast(flat.view(torch.uint8), 0).wait()
                    self.bytes_sent += flat.numel() * flat.element_size()
            except Exception as e:  # noqa: BLE001
                self._fail(member, e)

    def finish(self) -> dict[str, Any]:
        """The end of the stream to every live link; what went where."""
        for member, link in list(self.links.items()):
            try:
                HeaderChannel(link).bcast(None)
            except Exception as e:  # noqa: BLE001
                self._fail(member, e)
        return {"pool_sent": sorted(self.links), "pool_failed": self.failed, "pool_bytes_sent": self.bytes_sent}


def forget_links(members: list[str]) -> None:
    """Drop worker 0's links to members the controller declared gone."""
    for m in members:
        _links.pop(m, None)
