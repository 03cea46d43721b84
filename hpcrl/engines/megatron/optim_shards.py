"""The optimizer's state cut over the data-parallel ranks (ZeRO stage 1; megatron-core's
distributed optimizer does the same with flat buffers).

Without it every DP rank keeps AdamW's two fp32 moments (and, for a bf16 model, the fp32 master
weights) of every parameter: 8 (16) bytes per parameter, the same on every rank. With it
(`actor.optim.shard_over_dp`, default on) each DP rank keeps them for its share of the parameters
only, steps that share, and sends the stepped weights to the other ranks of its DP group.

What does not change: the gradients are still summed over DP on every rank, so the global norm
and the clipping are computed as before; AdamW is elementwise, so a parameter's update does not
depend on which rank computes it. The weights after a step are bit-identical to the unsharded
optimizer's (tests/test_checkpoint_world.py: a sharded save, loaded unsharded, steps to the same
bytes as the sharded run).

- `assign_owners`: whole tensors, largest first, each to the least-loaded rank: every rank computes
  the same assignment from the same shapes, with no communication.
- `OptimizerShards.broadcast_stepped`: after the owners' step, every parameter from its owner.
- `OptimizerShards.gather_to_first`: a checkpoint holds the whole state, as unsharded runs write
  it, so a save is read the same way at any layout or setting; DP rank 0 (the writer) receives the
  other ranks' shares at save time. A load keeps each rank's own share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def assign_owners(numels: Sequence[int], ranks: int) -> list[int]:
    """The DP rank that keeps and steps each tensor: largest first, to the rank with the fewest
    elements so far (ties: the lower rank)."""
    load = [0] * ranks
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


class OptimizerShards:
    """Which rank of one DP group owns which trainable parameter (in the engine's order), and the
    communication the sharded optimizer needs."""

    def __init__(self, numels: Sequence[int], group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.owners = assign_owners(numels, self.size)
        self._global = [dist.get_global_rank(group, r) for r in range(self.size)]
        # gloo moves CPU tensors, NCCL CUDA ones: where the receive buffers of a gather go
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu"))

    def owns(self, index: int) -> bool:
        return self.owners[index] == self.rank

    def broadcast_stepped(self, params: Sequence[torch.Tensor]) -> None:
        """Every parameter from the rank that stepped it (all queued at once, then waited on)."""
        import torch.distributed as dist

        works = [dist.broadcast(p.data, src=self._global[o], group=self.group, async_op=True)
                 for p, o in zip(params, self.owners, strict=True)]
        for w in works:
            w.wait()

    def gather_to_first(self, local: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]] | None:
        """Collective over the DP group. `local`: parameter index -> named tensors (optimizer state,
        master) of the parameters this rank owns. DP rank 0 gets every rank's entries (its own as
        given, the others' received into new tensors); the other ranks get None."""
        import torch.distributed as dist

        shapes = {i: {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in kinds.items()}
                  for i, kinds in local.items()}
        every: list[Any] = [None] * self.size
        dist.all_gather_object(every, shapes, group=self.group)
        if self.rank != 0:
            for i in sorted(local):
                for k in sorted(local[i]):
                    # 0-dim tensors (AdamW's step) travel as one element
                    dist.send(local[i][k].detach().reshape(-1).contiguous().to(self._device),
                              dst=self._global[0], group=self.group)
            return None
        out = dict(local)
        for r in range(1, self.size):
            for i in sorted(every[r]):
                out[i] = {}
                for k in sorted(every[r][i]):
                    shape, dtype = every[r][i][k]
                    buf = torch.empty(shape, dtype=getattr(torch, dtype), device=self._device)
                    dist.recv(buf.view(-1), src=self._global[r], group=self.group)
                    out[i][k] = buf
        return out
