"""The fully asynchronous rollout's bookkeeping (hpcrl.trainer.stream.RolloutStream), without engines:
segments appended with their versions, groups ready when all their samples end, the staleness bound,
partial rollout on and off, what a checkpoint keeps. The run itself: tests/test_train.py and
tests/test_resume.py (fully_async)."""

from __future__ import annotations

import torch

from hpcrl.engines.vllm.engine import Completion
from hpcrl.trainer.stream import RolloutStream, batch_of


def stream(bound: int = 1, partial: bool = True, total: int = 10) -> RolloutStream:
    # 2 prompts a batch, 2 samples each, at most 6 tokens a sample, 2 a segment
    return RolloutStream(n=2, max_new_tokens=6, segment_tokens=2, bound=bound, partial=partial, batch_groups=2,
                         total_batches=total, seed=1)


def segment(s: RolloutStream, ending: set[tuple[int, int]] = frozenset()) -> list:
    """Run one segment: every request gets 2 tokens (its uid*10 + sample, repeated), with log-prob
    -0.5; the (uid, sample) pairs in `ending` stop (EOS) there."""
    reqs = s.requests()
    outs = [Completion([r.group.uid * 10 + r.sample] * 2, [-0.5, -0.5],
                       "stop" if (r.group.uid, r.sample) in ending else "length") for r in reqs]
    s.absorb(reqs, outs)
    return reqs


def test_segments_versions_and_readiness() -> None:
    s = stream(bound=2)
    assert s.room()
    s.admit([(7, [1, 2]), (9, [3])])
    assert s.room() is True and [g.uid for g in s.groups] == [0, 1]  # 2 + 2 <= 2 x 2
    s.admit([(4, [5]), (5, [6])])
    assert not s.room()  # a third batch would be trained 3 steps after its first token
    reqs = segment(s, ending={(0, 0), (0, 1)})
    assert [r.max_tokens for r in reqs] == [2] * 8 and reqs[0].ids == [1, 2]
    # seeds differ by group, sample and segment
    assert len({r.seed for r in reqs}) == 8
    assert [g.done() for g in s.groups] == [True, False, False, False]
    assert s.take(trainer_version=0) is None  # one group ready, the batch needs two
    s.new_weights(1)
    reqs = segment(s)
    assert len(reqs) == 6 and reqs[0].ids == [3, 10, 10] and reqs[0].max_tokens == 2
    assert reqs[0].seed != s.requests()[0].seed  # the next segment of the same sample: another seed
    segment(s)  # 6 tokens: the limit ends them ("length" at the limit is the sample's end)
    assert all(g.done() for g in s.groups)
    first = s.take(trainer_version=1)
    assert [g.row for g in first] == [7, 9]
    # group 1's samples span versions 0, 1, 1 (2 tokens each); group 0 ended in the first segment
    assert first[1].samples[0].versions == [0, 0, 1, 1, 1, 1] and first[0].samples[0].versions == [0, 0]
    batch, m = batch_of(first, trainer_version=1)
    assert batch["token_version"][2].tolist() == [-1, 0, 0, 1, 1, 1, 1]  # row 2 = group 1, sample 0
    assert batch["policy_version"].tolist() == [0, 0, 0, 0]
    assert batch["rollout_logprob"][2].tolist() == [0.0] + [-0.5] * 6
    assert m["stream/multi_version_share"] == 0.5 and m["stream/staleness_max"] == 1.0
    # every sample's oldest token is of version 0, one behind the trainer: the whole batch in bin 1
    assert (m["stream/staleness_share_0"], m["stream/staleness_share_1"]) == (0.0, 1.0)
    assert "stream/staleness_share_2" not in m


def test_staleness_bound_restarts_a_group_and_counts_it() -> None:
    s = stream(bound=1)
    s.admit([(7, [1]), (9, [2])])
    assert not s.room()  # bound 1: nothing more until this batch is trained
    segment(s)
    s.new_weights(1)
    segment(s)
    s.new_weights(2)
    segment(s)
    # the trainer at version 2 takes tokens of version 0: 2 behind, over the bound of 1
    assert s.take(trainer_version=2) is None
    assert s.dropped_groups == 2 and s.thrown_tokens == 2 * 2 * 6
    assert all(g.restarts == 1 and g.tokens() == 0 for g in s.groups)
    for _ in range(3):
        segment(s)
    taken = s.take(trainer_version=2)
    assert [g.row for g in taken] == [7, 9] and {v for g in taken for x in g.samples for v in x.versions} == {2}


def test_without_partial_rollout_samples_in_flight_start_again() -> None:
    s = stream(partial=False)
    s.admit([(7, [1]), (9, [2])])
    segment(s, ending={(0, 0)})
    s.new_weights(1)
    kept = s.groups[0].samples[0]
    assert kept.tokens and kept.finish == "stop"  # a finished sample keeps its tokens
    assert [len(x.tokens) for g in s.groups for x in g.samples] == [2, 0, 0, 0] and s.thrown_tokens == 6
    control = stream(partial=True)
    control.admit([(7, [1]), (9, [2])])
    segment(control)
    control.new_weights(1)
    assert control.thrown_tokens == 0 and all(len(x.tokens) == 2 for g in control.groups for x in g.samples)


def test_draws_stop_at_the_run_length_and_the_state_round_trips() -> None:
    s = stream(bound=3, total=2)
    s.admit([(7, [1]), (9, [2])])
    s.admit([(4, [3]), (5, [4])])
    assert not s.room()  # the run trains 2 batches: nothing more is drawn
    segment(s, ending={(0, 0)})
    s.new_weights(1)
    other = stream(bound=3, total=2)
    other.load_state_dict(torch.load(_roundtrip(s.state_dict()), weights_only=True))
    assert other.state_dict() == s.state_dict()
    assert [r.seed for r in other.requests()] == [r.seed for r in s.requests()]


def _roundtrip(state: dict):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf
