"""Generation ahead of training (rollout.max_staleness = s > 0, split placement).

With s = 1 (one-step-off), step k of the loop is::

    engines (weights after step k-1):  generate batch k+1 ..........|
    trainer:                           train on batch k ............|-> collect and score batch k+1,
                                                                        send the weights after step k

Batch k was generated before step k-1's update was known, so it is one step stale: the loop
recomputes its old log-probs with the trainer's weights, and algorithm.rollout_correction=tis
weights each token by the truncated ratio of the trainer's to the sampler's probability. With s > 1,
s batches wait in the queue. A start or a resume generates the batches the queue lacks first.

Every batch carries the policy version that generated it (the optimizer steps of the loop behind
the engines' weights, also per sample as `policy_version`). The queue is part of a checkpoint
(`save` / `load`: the batches themselves, not their prompts), so a resumed run trains on exactly the
batches an uninterrupted run would, with no prompt skipped or repeated.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcrl.controller.batch import Batch

QUEUE_FILE = "rollouts_ahead.pt"


@dataclass
class Generated:
    """A scored batch waiting for its training step."""

    step: int  # the training step that will use it
    indices: list[int]  # its prompts' rows in the training set (row r of the batch answers r // n)
    batch: Batch
    scores: torch.Tensor
    metrics: dict[str, float]
    version: int  # the loop step whose weights generated it (0: the model file's)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "indices": self.indices, "tensors": {k: self.batch[k] for k in self.batch.keys()},
                "scores": self.scores, "metrics": self.metrics, "version": self.version}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Generated:
        return cls(d["step"], list(d["indices"]), Batch(dict(d["tensors"])), d["scores"], dict(d["metrics"]),
                   int(d["version"]))


class RolloutsAhead:
    """The batches generated ahead of their step, oldest first, and the one being generated."""

    def __init__(self, depth: int):
        self.depth = depth
        self.queue: deque[Generated] = deque()
        self.in_flight: Callable[[], Generated] | None = None

    def take(self, step: int) -> Generated:
        item = self.queue.popleft()
        if item.step != step:  # a queue out of step with the loop would train on the wrong data
            raise RuntimeError(f"the batch generated ahead is for step {item.step}, the loop is at step {step}")
        return item

    def save(self, folder: Path) -> list[dict[str, Any]]:
        """Write the queue into a checkpoint folder; the file records for its manifest. Nothing may be
        in flight (the loop collects every batch before a step ends)."""
        from hpcrl.checkpoint.files import file_record, is_no_space, write_durable
        from hpcrl.checkpoint.store import no_space_error

        if self.in_flight is not None:
            raise RuntimeError("a checkpoint while a batch is being generated would lose it")
        path = folder / QUEUE_FILE
        buf = io.BytesIO()
        torch.save([g.as_dict() for g in self.queue], buf)
        try:
            write_durable(path, buf.getvalue())
        except OSError as e:
            if is_no_space(e):  # the checkpointer's disk-full path: the save is removed, the run told
                raise no_space_error(path, "the batches generated ahead", buf.getbuffer().nbytes) from e
            raise
        return [file_record(path, folder)]

    def load(self, folder: Path) -> None:
        """The queue of a checkpoint folder (empty when it has none: a synchronous run's). Tensors and
        plain containers only: a pickle that holds code is refused, as for the RNG files."""
        import pickle

        from hpcrl.checkpoint.store import CheckpointError

        path = folder / QUEUE_FILE
        if not path.is_file():
            self.queue = deque()
            return
        try:
            saved = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path}: refused to load, it holds more than tensors and plain containers: "
                                  f"{e}") from None
        self.queue = deque(Generated.from_dict(d) for d in saved)
