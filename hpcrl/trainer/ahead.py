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
batches an uninterrupted run would, with no prompt skipped or repeated. Nothing is generated for a
step past trainer.total_steps.

A run resumed with a smaller rollout.max_staleness than the one that filled its queue (or with 0)
regenerates each saved batch that would be staler than the new bound, from the same prompts with
the current weights, and logs it; the queue then shrinks to the new depth.
"""

from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hpcrl.controller.batch import Batch

log = logging.getLogger("hpcrl.trainer")

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


# start(step, indices): start generating the batch of `step` with the engines' current weights and
# return at once; the function it returns waits for the samples and scores them. indices None: its
# prompts are the sampler's next batch; a list: those rows of the training set (a regenerated batch).
StartRollout = Callable[[int, "list[int] | None"], Callable[[], Generated]]


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

    def next_batch(self, step: int, total_steps: int, start: StartRollout,
                   now: Callable[[Callable[[], Generated]], Generated] = lambda generate: generate()) -> Generated:
        """The batch of `step`, whose engines hold the weights after step - 1. A start or a resume
        first generates what the queue lacks (never for a step past total_steps); a saved batch staler
        than `depth` (a resume with a smaller rollout.max_staleness) is regenerated from its prompts
        with the current weights. Then the batch `depth` steps ahead starts generating (collected by
        the caller after this step's update), unless the queue already holds that many. `now` runs
        each generation this step waits for (the caller times them)."""
        while len(self.queue) < max(self.depth, 1) and step + len(self.queue) <= total_steps:
            self.queue.append(now(partial(lambda at: start(at, None)(), step + len(self.queue))))
        item = self.take(step)
        staleness = step - 1 - item.version
        if staleness > self.depth:
            log.warning("the batch of step %d was generated with the weights after step %d (%d step(s) stale), more "
                        "than rollout.max_staleness=%d allows: regenerating its %d prompts with the current weights",
                        step, item.version, staleness, self.depth, len(item.indices))
            indices = list(item.indices)
            item = now(lambda: start(step, indices)())
        later = step + 1 + len(self.queue)
        if self.depth and len(self.queue) < self.depth and later <= total_steps:
            self.in_flight = start(later, None)
        return item

    def _serialized(self) -> bytes:
        buf = io.BytesIO()
        torch.save([g.as_dict() for g in self.queue], buf)
        return buf.getvalue()

    def nbytes(self) -> int:
        """Bytes `save` writes (0 without a queue): the checkpoint's disk-space check counts them."""
        return len(self._serialized()) if self.queue else 0

    def save(self, folder: Path) -> list[dict[str, Any]]:
        """Write the queue into a checkpoint folder; the file records for its manifest. Nothing may be
        in flight (the loop collects every batch before a step ends)."""
        from hpcrl.checkpoint.files import file_record, is_no_space, write_durable
        from hpcrl.checkpoint.store import no_space_error

        if self.in_flight is not None:
            raise RuntimeError("a checkpoint while a batch is being generated would lose it")
        path = folder / QUEUE_FILE
        data = self._serialized()
        try:
            write_durable(path, data)
        except OSError as e:
            if is_no_space(e):  # the checkpointer's disk-full path: the save is removed, the run told
                raise no_space_error(path, "the batches generated ahead", len(data)) from e
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
