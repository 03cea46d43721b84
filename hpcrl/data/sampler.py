"""Which prompts go into each step's batch, reproducibly across preemption and resume.

Every epoch is a fresh permutation derived only from (seed, epoch), so the sampler's whole state is
three integers and a resumed run sees exactly the batches an uninterrupted run would have seen.
Batches never span epochs: when fewer than batch_size rows are left in an epoch, they are dropped
and the next epoch starts (a step's batch is a fixed size for the GRPO group and mini-batch arithmetic;
with shuffling, each epoch drops different rows). Validation uses `iterate_batches`, which keeps all
rows in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


class ShuffledSampler:
    """Batches of dataset indices; a new permutation every epoch from (seed, epoch); batches never span
    epochs (the partial batch at the end of an epoch is dropped). The permutation comes from numpy's
    PCG64 generator: resume with the same numpy to get the same order."""

    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError(f"sampler: the dataset is empty (num_rows={num_rows}).")
        if batch_size < 1:
            raise ValueError(f"sampler: batch_size={batch_size} must be >= 1.")
        if batch_size > num_rows:
            raise ValueError(f"sampler: batch_size={batch_size} is larger than the dataset ({num_rows} rows); "
                             "lower data.train_batch_size or add data.")
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, int(seed), bool(shuffle)
        self.epoch = 0
        self.index = 0  # rows of this epoch's order already handed out
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def _order_for(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed % 2**63, epoch])
                self._order = rng.permutation(self.num_rows)
            else:
                self._order = np.arange(self.num_rows)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[int]:
        if self.index + self.batch_size > self.num_rows:
            self.epoch, self.index = self.epoch + 1, 0
        order = self._order_for(self.epoch)
        batch = order[self.index:self.index + self.batch_size].tolist()
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "index", "seed"} plus what must match on restore ("num_rows", "shuffle") and the
        batch size (informational: a restored sampler may use another batch size from the same row)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_rows": self.num_rows,
                "shuffle": int(self.shuffle), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Refused when it was saved for another seed, dataset size or shuffle
        setting: the permutation would differ and the run would silently repeat or skip prompts."""
        for key, mine in (("seed", self.seed), ("num_rows", self.num_rows), ("shuffle", int(self.shuffle))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"sampler state from a checkpoint has {key}={int(state[key])} but this run has "
                                 f"{key}={mine} (data.seed / the data files / data.shuffle changed); resume with "
                                 "the same data settings or start a fresh run.")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.num_rows:
            raise ValueError(f"sampler state epoch={epoch}, index={index} is out of range for {self.num_rows} rows.")
        self.epoch, self.index = epoch, index


def iterate_batches(rows: Sequence[T], batch_size: int) -> Iterator[list[T]]:
    """`rows` (e.g. a PromptDataset) in order, batch_size at a time, the last batch possibly shorter:
    validation scores every prompt exactly once."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    for start in range(0, len(rows), batch_size):
        yield [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
