"""The wire format between the controller and the Megatron roles, and mini-batch arrangement.

A rollout batch is a `Batch` of right-padded rows:
  input_ids [B, S] long, attention_mask [B, S] (1 = real token), response_mask [B, S] (1 = a
  generated token that the losses count). Per-token quantities (log-probs, values, advantages,
  returns) are token-aligned [B, S]: entry t belongs to token t (its log-prob is log p(ids[t] |
  ids[<t]); its value is that of the state just before it). Entry 0 has no prediction and is 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hpcrl.algos.losses import token_weights
from hpcrl.controller.batch import Batch


def sequences(batch: Batch) -> list[torch.Tensor]:
    """The unpadded token sequences of a batch."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    ids = batch["input_ids"]
    return [ids[i, :int(n)] for i, n in enumerate(lengths)]


def to_label_aligned(batch: Batch, key: str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Token-aligned [B, S] -> per sequence [len-1], entry t for the prediction of token t+1."""
    x = batch[key]
    return [x[i, 1:s.numel()] for i, s in enumerate(seqs)]


def to_token_aligned(values: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """Per sequence [len-1] (label-aligned) -> token-aligned [B, S] with zeros elsewhere."""
    out = torch.zeros(shape, dtype=values[0].dtype if values else torch.float32)
    for i, v in enumerate(values):
        out[i, 1:1 + v.numel()] = v
    return out


def minibatch_rows(b: int, num_minibatches: int, shuffle_seed: int | None = None,
                   groups: list[int] | None = None) -> list[list[int]]:
    """Rows of the input batch in each mini-batch: consecutive runs of B / num_minibatches rows,
    of a seeded permutation when shuffle_seed is given. With groups (a group id per row: the
    prompt of each sample), the permutation is of the groups, each group's rows kept together in
    their order: the samples of one prompt then sit in one mini-batch (when its size is a multiple
    of the group size, as verl counts mini-batches in prompts), and on one rank, where the engine
    packs their prompt once (actor.share_prompt)."""
    if shuffle_seed is None:
        order = list(range(b))
    elif groups is None:
        order = torch.randperm(b, generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    else:
        members = list(rows_by_group(range(b), groups).values())  # by first appearance
        perm = torch.randperm(len(members), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
        order = [i for k in perm for i in members[k]]
    m = b // num_minibatches
    return [order[k * m:(k + 1) * m] for k in range(num_minibatches)]


def rows_by_group(rows: Iterable[int], groups: list[int]) -> dict[int, list[int]]:
    """The rows of each group (groups[row]), groups in the order of their first row, rows of a
    group in their order."""
    members: dict[int, list[int]] = {}
    for r in rows:
        members.setdefault(groups[r], []).append(r)
    return members


def arrange_minibatches(batch: Batch, num_minibatches: int, dp_size: int, loss_agg_mode: str,
                        mask_key: str = "response_mask", shuffle_seed: int | None = None,
                        group_key: str | None = "prompt_index") -> Batch:
    """Reorder a step's batch so that the DP split gives every rank an equal part of every
    mini-batch, and attach per-token loss weights normalised over each whole mini-batch.

    Mini-batch k is `minibatch_rows(...)[k]` (rows [k*M, (k+1)*M) of the input, M = B /
    num_minibatches, or of its seeded shuffle: by prompt when the batch has `group_key`, by sample
    when group_key is None). Inside a mini-batch the samples of one prompt (the batch's
    "prompt_index", when it has one) are put next to each other, so the DP split keeps them on one
    rank (all but at most one prompt per cut between two ranks), where the engine packs their
    prompt once (actor.share_prompt); a cut by sample then repacks a prompt about once per
    mini-batch it is dealt to, not once per (mini-batch, rank). After the reordering, DP shard d
    (contiguous, as DP dispatch cuts it) holds, in order, part d of mini-batch 0, part d of
    mini-batch 1, ...; a rank cuts its shard into num_minibatches contiguous chunks. Because the
    weights are global, the update is the same for any DP size and any order inside a mini-batch.
    """
    b = len(batch)
    if b % num_minibatches or (b // num_minibatches) % dp_size:
        raise ValueError(f"{b} samples do not split into {num_minibatches} mini-batches of equal parts "
                         f"over {dp_size} data-parallel ranks")
    if shuffle_seed is not None:
        groups = batch[group_key].tolist() if group_key is not None and group_key in batch.keys() else None
        cut = minibatch_rows(b, num_minibatches, shuffle_seed, groups)
        if groups is None and "prompt_index" in batch.keys():  # a cut by sample: put each prompt's samples together
            prompts = batch["prompt_index"].tolist()
            cut = [[r for g in rows_by_group(rows, prompts).values() for r in g] for rows in cut]
        batch = batch.select([i for rows in cut for i in rows])
    m = b // num_minibatches
    part = m // dp_size
    weights = torch.zeros(batch[mask_key].shape, dtype=torch.float32)
    mask = batch[mask_key].float()
    for k in range(num_minibatches):
        rows = range(k * m, (k + 1) * m)
        per_seq = token_weights([mask[i] for i in rows], loss_agg_mode)
        for i, w in zip(rows, per_seq):
            weights[i] = w
    order = [k * m + d * part + j for d in range(dp_size) for k in range(num_minibatches) for j in range(part)]
    out = batch.select(order)
    out["loss_weight"] = weights[order]
    return out
