"""Fully asynchronous rollout (rollout.mode=fully_async, split placement): the engines generate without
waiting for training steps, and the trainer takes a batch as soon as enough groups have finished.

    engines:  seg seg seg seg seg seg seg |load k| seg seg seg seg ...
    trainer:  [batch?] old log-probs, update of step k ...  |send | [batch?] old log-probs, update ...

- Generation runs in segments: one engine call per rollout replica gives every sample in flight up to
  rollout.segment_tokens more tokens (vLLM prefills prompt + tokens so far). The controller starts the
  next segment as soon as one returns, also while it waits for the trainer (ControllerRuntime.idle).
- After a step's update the segment in flight finishes, the new weights load (the engines reset their
  prefix cache with them) and generation goes on. With rollout.partial_rollout (the default) the
  unfinished samples keep their tokens, each with its behaviour log-prob and the version of the weights
  that made it (the loop step behind them, 0: the model's own), and continue from them; without it they
  start again from their prompts, their tokens counted as thrown away.
- A group (the rollout.n samples of one prompt) is ready when all its samples have finished. The
  trainer takes data.train_batch_size ready groups, those drawn first first. A group holding a token
  more than rollout.max_staleness versions behind the trainer's weights is never trained: it starts
  again from its prompt (counted), so every prompt drawn is still trained exactly once.
- Prompts are drawn from the sampler a batch at a time while at most max_staleness - 1 batches of
  groups wait to be trained (`RolloutStream.room`), and no more than the run's steps need: generation
  runs ahead of training by max_staleness steps at most.
- At a step boundary nothing is in flight, and the stream (groups, tokens, log-probs, versions,
  counters) is part of the checkpoint (`STREAM_FILE`) beside the sampler's cursor: a resumed run goes on
  with every sample it had, and trains each prompt once.

- Rollout pools (hpcrl.pools): live workers of other Slurm jobs take an even share of each segment
  beside the rollout group's replicas (`SegmentParts`); the share of a worker that leaves comes back
  with no tokens, so its samples continue in the next segment. Each token records whether a pool
  worker made it (`Sample.pooled`).

`RolloutStream` is the state (no controller, no engine); `StreamDriver` runs it on the rollout group.
The batch and its metrics come from `batch_of` and `StreamDriver.step_metrics`; hpcrl.trainer.ppo
calls them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpcrl.controller.batch import Batch, even_sizes
from hpcrl.engines.vllm.engine import SEED_SPACE, Completion, SamplingSettings

log = logging.getLogger("hpcrl.trainer")

STREAM_FILE = "stream.pt"


@dataclass
class Sample:
    """One sample being generated or finished: its tokens with their behaviour log-probs and versions."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # vLLM's finish reason once finished; None while generating
    # 1 for each token a rollout pool worker made (hpcrl.pools), 0 for the run's own engines
    pooled: list[int] = field(default_factory=list)


@dataclass
class Group:
    """The rollout.n samples of one prompt (row `row` of the training set), drawn as the uid-th."""

    uid: int
    row: int
    prompt: list[int]
    samples: list[Sample]
    restarts: int = 0

    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest(self) -> int | None:
        versions = [v for s in self.samples for v in s.versions]
        return min(versions) if versions else None

    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)


@dataclass
class Request:
    """One sample's next segment: the group and sample it continues, what it sends, its seed."""

    group: Group
    sample: int
    ids: list[int]
    seed: int
    max_tokens: int
    pooled: int = 0  # sent to a rollout pool worker


class RolloutStream:
    """The groups drawn and not yet trained (module docstring), and what was thrown away."""

    def __init__(self, n: int, max_new_tokens: int, segment_tokens: int, bound: int, partial: bool,
                 batch_groups: int, total_batches: int, seed: int):
        self.n, self.max_new_tokens, self.segment_tokens = n, max_new_tokens, segment_tokens
        self.bound, self.partial, self.batch_groups = bound, partial, batch_groups
        self.total_batches, self.seed = total_batches, seed
        self.groups: list[Group] = []
        self.version = 0  # the step whose weights the engines run
        self.drawn_batches = 0  # sampler batches drawn since the run began (never more than it trains)
        self.thrown_tokens = 0
        self.dropped_groups = 0

    def room(self) -> bool:
        """Another sampler batch may be drawn: with Q groups waiting to be trained, a batch drawn now is
        trained Q / batch + 1 steps later at the latest, so its tokens are at most that many versions
        behind; Q + batch <= bound x batch keeps them within the bound (rollout.max_staleness >= 1)."""
        return (len(self.groups) + self.batch_groups <= self.bound * self.batch_groups
                and self.drawn_batches < self.total_batches)

    def admit(self, rows: list[tuple[int, list[int]]]) -> None:
        """A sampler batch of (row, prompt ids), each a new group of n samples."""
        first = self.drawn_batches * self.batch_groups
        self.groups += [Group(first + i, row, list(prompt), [Sample() for _ in range(self.n)])
                        for i, (row, prompt) in enumerate(rows)]
        self.drawn_batches += 1

    def _seed(self, g: Group, j: int) -> int:
        # a fresh stream for every segment: a continuation must not replay its start's random numbers
        key = f"{self.seed}/stream/{g.uid}/{g.restarts}/{j}/{len(g.samples[j].tokens)}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % SEED_SPACE

    def requests(self) -> list[Request]:
        """The next segment of every unfinished sample, in the order groups were drawn."""
        return [Request(g, j, g.prompt + s.tokens, self._seed(g, j),
                        min(self.segment_tokens, self.max_new_tokens - len(s.tokens)))
                for g in self.groups for j, s in enumerate(g.samples) if s.finish is None]

    def absorb(self, requests: list[Request], completions: list[Completion]) -> int:
        """Append each segment's tokens (made by the current version); returns the tokens added."""
        added = 0
        for req, c in zip(requests, completions, strict=True):
            s = req.group.samples[req.sample]
            s.tokens += list(c.token_ids)
            s.logprobs += list(c.logprobs)
            s.versions += [self.version] * len(c.token_ids)
            s.pooled += [req.pooled] * len(c.token_ids)
            added += len(c.token_ids)
            # "length" with room left is the segment's end, not the sample's
            if c.finish_reason != "length" or len(s.tokens) >= self.max_new_tokens:
                s.finish = c.finish_reason
        return added

    def _restart(self, g: Group) -> None:
        self.thrown_tokens += g.tokens()
        g.samples = [Sample() for _ in range(self.n)]
        g.restarts += 1

    def new_weights(self, version: int) -> None:
        """The engines now run the weights after step `version`. Without partial rollout every sample
        in flight starts again (its tokens are thrown away)."""
        self.version = version
        if not self.partial:
            for g in self.groups:
                for j, s in enumerate(g.samples):
                    if s.finish is None and s.tokens:
                        self.thrown_tokens += len(s.tokens)
                        g.samples[j] = Sample()

    def take(self, trainer_version: int) -> list[Group] | None:
        """A batch of ready groups for the trainer, which holds the weights after step
        `trainer_version`, or None when fewer are ready. Groups that can no longer be trained (a
        token more than `bound` versions behind) start again first."""
        for g in self.groups:
            oldest = g.oldest()
            if oldest is not None and trainer_version - oldest > self.bound:
                self.dropped_groups += 1
                self._restart(g)
        ready = sorted((g for g in self.groups if g.done()), key=lambda g: g.uid)[:self.batch_groups]
        if len(ready) < self.batch_groups:
            return None
        taken = {g.uid for g in ready}
        self.groups = [g for g in self.groups if g.uid not in taken]
        return ready

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [asdict(g) for g in self.groups], "version": self.version,
                "drawn_batches": self.drawn_batches, "thrown_tokens": self.thrown_tokens,
                "dropped_groups": self.dropped_groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [Group(int(g["uid"]), int(g["row"]), list(g["prompt"]),
                             [_sample(s) for s in g["samples"]], int(g["restarts"])) for g in state["groups"]]
        self.version = int(state["version"])
        self.drawn_batches = int(state["drawn_batches"])
        self.thrown_tokens = int(state["thrown_tokens"])
        self.dropped_groups = int(state["dropped_groups"])


def _sample(state: dict[str, Any]) -> Sample:
    s = Sample(**state)
    # a stream saved before rollout pools: every token its own engines'
    s.pooled = s.pooled or [0] * len(s.tokens)
    return s


def batch_of(groups: list[Group], trainer_version: int) -> tuple[Batch, dict[str, Any]]:
    """The wire-format batch of taken groups (hpcrl.workers.actor_rollout's layout: sample j of group
    i in row i * n + j), with `token_version` [B, S] (-1 outside the response) and `policy_version` [B]
    (each sample's oldest token's); and the staleness metrics of its samples."""
    from hpcrl.workers.actor_rollout import assemble_batch

    per_prompt = [[Completion(s.tokens, s.logprobs, s.finish or "length") for s in g.samples] for g in groups]
    batch = assemble_batch([g.prompt for g in groups], per_prompt)
    versions = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
    oldest = []
    spanning = 0
    for r, s in enumerate(s for g in groups for s in g.samples):
        start = len(groups[r // len(groups[0].samples)].prompt)
        versions[r, start:start + len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
        oldest.append(min(s.versions) if s.versions else trainer_version)
        spanning += len(set(s.versions)) > 1
    batch["token_version"] = versions
    batch["policy_version"] = torch.tensor(oldest, dtype=torch.long)
    stale = [trainer_version - v for v in oldest]
    # the batch's staleness histogram: the share of its samples k versions behind, k = 0..max
    histogram = {f"stream/staleness_share_{k}": stale.count(k) / len(stale) for k in range(max(stale) + 1)}
    return batch, {"stream/staleness_mean": sum(stale) / len(stale), "stream/staleness_max": float(max(stale)),
                   **histogram, "stream/multi_version_share": spanning / len(stale),
                   "rollout/policy_version": float(min(oldest)), "rollout/staleness": float(max(stale))}


class SegmentParts:
    """One segment in flight on the rollout group and on pool workers, each part a share of its
    requests in order: done when every part is; completions in request order (a part whose pool
    worker went answers with no tokens)."""

    def __init__(self, parts: list[Any]):
        self.parts = parts

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def result(self) -> list[Completion]:
        return [c for p in self.parts for c in p.result()]


class StreamDriver:
    """Runs a RolloutStream on the split placement's rollout group: segments in flight one at a time,
    started whenever the last one has returned and the stream is not paused (a weight load or a
    checkpoint needs the engines still)."""

    def __init__(self, stream: RolloutStream, group: Any, sampling: SamplingSettings,
                 draw: Callable[[], list[tuple[int, list[int]]]], pools: Any = None):
        self.stream, self.group, self.sampling, self.draw = stream, group, sampling, draw
        self.pools = pools  # hpcrl.pools.registry.PoolRegistry: workers of other jobs that take shares
        self.coords: list[tuple[int, int]] = group.rollout_coords()
        self.replicas = len({d for d, _ in self.coords})
        self.pending: tuple[Any, list[Request], float] | None = None
        self.paused = True
        # set while the driver itself waits for a segment: the wait runs ControllerRuntime.idle, which
        # must not collect that segment a second time nor start another beside it
        self._inside = False
        self.busy_s = 0.0  # seconds with a segment in flight, since the last step_metrics
        self.tokens = 0  # tokens generated since the last step_metrics
        self._marks = (0, 0, time.perf_counter())  # thrown tokens, dropped groups, time at the last metrics

    def pump(self) -> None:
        """Collect a finished segment and start the next; never blocks."""
        if self.pools is not None:
            self.pools.poll()
        if self._inside:
            return
        if self.pending is not None and self.pending[0].done():
            self._collect()
        if self.pending is None and not self.paused:
            self._start()

    def _start(self) -> None:
        from hpcrl.workers.actor_rollout import start_generate_each

        s = self.stream
        while s.room():
            s.admit(self.draw())
        reqs = s.requests()
        if not reqs:
            return
        # the rollout group's replicas and each idle live pool worker get an even share, in request order
        members = self.pools.idle_live() if self.pools is not None else []
        sizes = even_sizes(len(reqs), self.replicas + len(members))
        own = sum(sizes[:self.replicas])
        parts: list[Any] = []
        if own:
            parts.append(start_generate_each(self.group, [r.ids for r in reqs[:own]], self.sampling,
                                             [r.seed for r in reqs[:own]], [r.max_tokens for r in reqs[:own]],
                                             coords=self.coords))
        start = own
        for member, size in zip(members, sizes[self.replicas:]):
            if size:
                share = reqs[start:start + size]
                for r in share:
                    r.pooled = 1
                parts.append(self.pools.start_part(member, [(r.ids, r.seed, r.max_tokens) for r in share],
                                                   self.sampling))
            start += size
        self.pending = (SegmentParts(parts), reqs, time.perf_counter())

    def _collect(self) -> None:
        assert self.pending is not None
        pending, reqs, started = self.pending
        self._inside = True
        try:
            completions = pending.result()
        finally:
            self._inside = False
        self.pending = None
        self.tokens += self.stream.absorb(reqs, completions)
        self.busy_s += time.perf_counter() - started

    def next_batch(self, trainer_version: int) -> list[Group]:
        """The trainer's next batch, generating (and waiting) until it is ready."""
        self.paused = False
        while True:
            groups = self.stream.take(trainer_version)
            if groups is not None:
                return groups
            self.pump()
            if self.pending is None:
                raise RuntimeError(f"the stream cannot make a batch: {len(self.stream.groups)} group(s), "
                                   f"{self.stream.drawn_batches} of {self.stream.total_batches} batch(es) drawn")
            self._collect()  # wait for the segment in flight (the trainer has nothing to do)

    def settle(self) -> None:
        """Let the segment in flight finish and start no other (before a weight load or a checkpoint)."""
        self.paused = True
        if self.pending is not None:
            self._collect()

    def step_metrics(self) -> dict[str, float]:
        """The engines' share of the step spent idle, tokens generated and thrown away, groups dropped
        for staleness, groups in flight or waiting, since the last call."""
        s = self.stream
        thrown, dropped, since = self._marks
        now = time.perf_counter()
        wall = max(now - since, 1e-9)
        out = {"stream/engine_idle_frac": max(0.0, 1.0 - self.busy_s / wall),
               "stream/tokens_generated": float(self.tokens),
               "stream/tokens_thrown_away": float(s.thrown_tokens - thrown),
               "stream/dropped_groups": float(s.dropped_groups - dropped),
               "stream/groups_waiting": float(sum(g.done() for g in s.groups)),
               "stream/groups_in_flight": float(sum(not g.done() for g in s.groups))}
        self._marks = (s.thrown_tokens, s.dropped_groups, now)
        self.busy_s, self.tokens = 0.0, 0
        # the engines that generate for the run: its own rollout workers and the live pool workers
        live = len(self.pools.live()) if self.pools is not None else 0
        out["rollout/workers"] = float(len(self.coords) + live)
        if self.pools is not None:
            out.update(self.pools.step_metrics())
        return out

    def save(self, folder: Path) -> list[dict[str, Any]]:
        """The stream into a checkpoint folder (nothing may be in flight); its file records."""
        import io

        from hpcrl.checkpoint.files import file_record, is_no_space, write_durable
        from hpcrl.checkpoint.store import no_space_error

        if self.pending is not None:
            raise RuntimeError("a checkpoint while a segment is being generated would lose it")
        buf = io.BytesIO()
        torch.save(self.stream.state_dict(), buf)
        try:
            write_durable(folder / STREAM_FILE, buf.getvalue())
        except OSError as e:
            if is_no_space(e):  # the checkpointer's disk-full path: the save is removed, the run told
                raise no_space_error(folder / STREAM_FILE, "the fully_async stream", len(buf.getvalue())) from e
            raise
        return [file_record(folder / STREAM_FILE, folder)]

    def nbytes(self) -> int:
        return 4096 + sum(16 * (len(g.prompt) + g.tokens()) for g in self.stream.groups)

    def load(self, folder: Path) -> None:
        """The stream of a checkpoint folder, if it has one (else the run starts with none)."""
        path = folder / STREAM_FILE
        if path.is_file():
            self.stream.load_state_dict(torch.load(path, weights_only=True))
            # the step metrics count from here (the loaded counters are the run's so far)
            self._marks = (self.stream.thrown_tokens, self.stream.dropped_groups, time.perf_counter())
            log.info("resumed with %d group(s) of the stream (%d finished), weights version %d",
                     len(self.stream.groups), sum(g.done() for g in self.stream.groups), self.stream.version)


def make_stream(cfg: Any, rollout: dict[str, Any], group: Any,
                draw: Callable[[], list[tuple[int, list[int]]]], pools: Any = None) -> StreamDriver:
    """The fully asynchronous rollout of a config on the rollout group (`rollout`: the config's rollout
    section as plain data; `draw`: the sampler's next batch as (row, prompt ids)), pumped whenever the
    controller waits for a worker group."""
    from hpcrl.config.derived import stream_staleness
    from hpcrl.controller.runtime import get_runtime

    r = cfg.rollout
    stream = RolloutStream(n=int(r.n), max_new_tokens=int(r.max_new_tokens), segment_tokens=int(r.segment_tokens),
                           bound=stream_staleness(cfg), partial=r.partial_rollout is not False,
                           batch_groups=int(cfg.data.train_batch_size), total_batches=int(cfg.trainer.total_steps),
                           seed=int(cfg.trainer.seed))
    driver = StreamDriver(stream, group, SamplingSettings.from_rollout_config(rollout), draw, pools)
    get_runtime().idle = driver.pump
    return driver


def gap_by_version(batch: Batch, trainer_version: int) -> dict[str, float]:
    """The stream's behaviour log-probs against the trainer's recomputed ones, apart for the tokens the
    trainer's own weights made (equal up to the engines' rounding) and those older weights made."""
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_logprob"] - batch["old_logprob"]).abs()
    current = mask & (batch["token_version"] == trainer_version)
    older = mask & (batch["token_version"] < trainer_version)
    return {"stream/gap_current_version_max": float(diff[current].max()) if current.any() else 0.0,
            "stream/gap_older_versions_mean": float(diff[older].mean()) if older.any() else 0.0,
            "stream/older_version_token_share": float(older.sum()) / max(float(mask.sum()), 1.0)}
