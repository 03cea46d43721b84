"""Data subsystem: verl-schema prompt datasets (parquet, jsonl, json) with the chat template applied,
length filtering, named errors, and the resumable shuffled sampler."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ARITH, TINY_MODEL

from hpcrl.data import PromptDataset, ShuffledSampler, iterate_batches

VAL = ARITH / "val.parquet"
TRAIN = ARITH / "train.parquet"


@pytest.fixture(scope="module")
def tok():
    if not VAL.is_file() or not (TINY_MODEL / "tokenizer.json").is_file():
        pytest.fail("run `make models data` first (models/tiny-qwen2, data/arith)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_MODEL))


def template_ids(tok, messages) -> list[int]:
    """The reference: the tokenizer's own chat templating, tokenized by it."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_parquet_rows_match_chat_template(tok):
    rows = pq.read_table(VAL).to_pylist()
    ds = PromptDataset([str(VAL)], tok, max_prompt_length=512)
    assert (len(ds), ds.num_filtered) == (len(rows), 0) == (200, 0)
    for i in (0, 57, 199):
        r, msgs = ds[i], rows[i]["prompt"]
        assert r.prompt_text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert r.prompt_text.startswith("<|im_start|>user\n") and r.prompt_text.endswith("<|im_start|>assistant\n")
        assert r.prompt_ids == template_ids(tok, msgs)
        assert r.data_source == "hpcrl/arith"
        assert r.ground_truth == rows[i]["reward_model"]["ground_truth"]
        assert r.extra_info == rows[i]["extra_info"] and r.extra_info["index"] == i
        assert r.index == i
    with pytest.raises(IndexError):
        ds[200]


def test_files_concatenate_in_order(tok):
    ds = PromptDataset([str(TRAIN), str(VAL)], tok, max_prompt_length=512)
    assert len(ds) == 2200
    assert (ds[1999].extra_info["split"], ds[1999].extra_info["index"]) == ("train", 1999)
    assert (ds[2000].extra_info["split"], ds[2000].extra_info["index"], ds[2000].index) == ("val", 0, 2000)


def test_length_filter_exact(tok, caplog):
    rows = pq.read_table(VAL).to_pylist()
    lengths = [len(template_ids(tok, r["prompt"])) for r in rows]
    limit = sorted(lengths)[len(lengths) // 2]  # about half the prompts are longer
    want_kept = [i for i, n in enumerate(lengths) if n <= limit]
    caplog.set_level(logging.INFO, logger="hpcrl.data")
    ds = PromptDataset([str(VAL)], tok, max_prompt_length=limit)
    assert 0 < ds.num_filtered == len(rows) - len(want_kept) < len(rows)
    assert [ds[i].extra_info["index"] for i in range(len(ds))] == want_kept  # order kept
    assert max(len(ds[i].prompt_ids) for i in range(len(ds))) == limit  # a prompt of exactly the limit stays
    assert f"{ds.num_filtered} filtered out" in caplog.text


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "What is 8 * 9?"}],
     "reward_model": {"style": "rule", "ground_truth": 72}, "extra_info": {"id": "a"}},
    {"data_source": "math", "prompt": "Simplify 2/4.", "reward_model": {"ground_truth": "\\frac{1}{2}"}},
    {"data_source": "hpcrl/arith",
     "prompt": [{"role": "user", "content": "Add these numbers together please: " + " + ".join(["1"] * 40)}],
     "reward_model": {"ground_truth": "40"}, "extra_info": None},
]


def test_jsonl_and_json(tok, tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = PromptDataset([f], tok, max_prompt_length=512)
    assert len(ds) == 3
    assert ds[0].prompt_ids == template_ids(tok, ROWS[0]["prompt"])
    assert ds[0].prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 8 * 9?")
    assert (ds[0].ground_truth, ds[0].extra_info) == ("72", {"id": "a"})  # a numeric ground truth becomes text
    # a bare string prompt is one user turn; missing or null extra_info is {}
    assert ds[1].prompt_ids == template_ids(tok, [{"role": "user", "content": "Simplify 2/4."}])
    assert (ds[1].ground_truth, ds[1].extra_info, ds[2].extra_info) == ("\\frac{1}{2}", {}, {})
    # .json: JSON lines or one array
    (tmp_path / "lines.json").write_text((tmp_path / "p.jsonl").read_text())
    (tmp_path / "array.json").write_text(json.dumps(ROWS))
    for name in ("lines.json", "array.json"):
        other = PromptDataset([str(tmp_path / name)], tok)
        assert [other[i].prompt_ids for i in range(3)] == [ds[i].prompt_ids for i in range(3)]


def test_jsonl_boundary_and_prompt_key(tok, tmp_path):
    n0, n1, n2 = (len(template_ids(tok, _msgs(r["prompt"]))) for r in ROWS)
    assert n2 > max(n0, n1)
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    kept = PromptDataset([f], tok, max_prompt_length=n2)
    assert (len(kept), kept.num_filtered) == (3, 0)
    cut = PromptDataset([f], tok, max_prompt_length=n2 - 1)
    assert (len(cut), cut.num_filtered) == (2, 1)
    assert [cut[i].data_source for i in range(2)] == ["gsm8k", "math"]
    renamed = [{("question" if k == "prompt" else k): v for k, v in r.items()} for r in ROWS]
    g = write_jsonl(tmp_path / "q.jsonl", renamed)
    assert len(PromptDataset([g], tok, prompt_key="question")) == 3


def _msgs(p):
    return [{"role": "user", "content": p}] if isinstance(p, str) else p


def test_errors_name_file_and_key(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet: no such data file"):
        PromptDataset([str(tmp_path / "nope.parquet")], tok)
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported data file type '\.csv'"):
        PromptDataset([str(csv)], tok)
    no_source = write_jsonl(tmp_path / "s.jsonl", [{k: v for k, v in ROWS[1].items() if k != "data_source"}])
    with pytest.raises(ValueError, match=r"s\.jsonl: row 0 has no 'data_source'"):
        PromptDataset([no_source], tok)
    no_truth = write_jsonl(tmp_path / "t.jsonl", [ROWS[0], dict(ROWS[1], reward_model={"style": "rule"})])
    with pytest.raises(ValueError, match=r"t\.jsonl: row 1 has no 'reward_model\.ground_truth'"):
        PromptDataset([no_truth], tok)
    with pytest.raises(ValueError, match=r"t\.jsonl: row 0 has no 'question'"):
        PromptDataset([no_truth], tok, prompt_key="question")
    pq.write_table(pa.Table.from_pylist([{"data_source": "gsm8k", "prompt": "hi"}]), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"m\.parquet: row 0 has no 'reward_model\.ground_truth'"):
        PromptDataset([str(tmp_path / "m.parquet")], tok)
    bad_prompt = write_jsonl(tmp_path / "b.jsonl", [dict(ROWS[1], prompt=[{"role": "user"}])])
    with pytest.raises(ValueError, match=r"b\.jsonl: row 0: 'prompt' must be chat messages"):
        PromptDataset([bad_prompt], tok)
    broken = tmp_path / "j.jsonl"
    broken.write_text(json.dumps(ROWS[1]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"j\.jsonl: line 2 is not valid JSON"):
        PromptDataset([str(broken)], tok)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="hold no rows"):
        PromptDataset([str(tmp_path / "e.jsonl")], tok)
    with pytest.raises(ValueError, match=r"all 3 prompts .* longer than data\.max_prompt_length=5 tokens.*raise "
                                         r"data\.max_prompt_length"):
        PromptDataset([write_jsonl(tmp_path / "p.jsonl", ROWS)], tok, max_prompt_length=5)


def test_malformed_rows_are_skipped_with_their_numbers_up_to_a_share(tok, tmp_path, caplog):
    good = [json.dumps(dict(ROWS[1], prompt=f"Simplify {i}/4.")).encode() for i in range(20)]
    bad = [json.dumps({k: v for k, v in ROWS[1].items() if k != "prompt"}).encode(),  # no prompt
           json.dumps(dict(ROWS[1], prompt=7)).encode(),  # wrong type
           json.dumps(dict(ROWS[1], reward_model={"ground_truth": " "})).encode(),  # empty ground truth
           b'{"prompt": "caf\xe9", "data_source": "math"}',  # not UTF-8 (latin-1 bytes)
           b'{"prompt": "What is 1 +']  # cut off
    lines = good[:10] + bad + good[10:]  # the bad rows are lines 11-15 (rows 10-14)
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    caplog.set_level(logging.WARNING, logger="hpcrl.data")
    ds = PromptDataset([str(f)], tok, max_skipped_row_share=0.25)
    assert (len(ds), ds.num_skipped) == (20, 5)
    assert [ds[i].prompt_text.count("Simplify") for i in range(20)] == [1] * 20
    assert "skipped 5 of 25 rows" in caplog.text
    for where in ("row 10 has no 'prompt'", "row 11: 'prompt' must be chat messages",
                  "row 12: 'reward_model.ground_truth' is empty", "line 14 is not valid UTF-8",
                  "line 15 is not valid JSON"):
        assert where in caplog.text, where
    # above the share the file is refused, with the same numbers
    with pytest.raises(ValueError, match=r"mixed\.jsonl: 5 of 25 rows unusable \(20\.0%; "
                                         r"data\.max_skipped_row_share=0\.1\).*row 10 has no 'prompt'"):
        PromptDataset([str(f)], tok, max_skipped_row_share=0.1)


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_epochs_cover_rows_once():
    s = ShuffledSampler(10, 3, seed=7)
    assert s.batches_per_epoch == 3
    batches = take(s, 9)  # three epochs
    for e in range(3):
        epoch = [i for b in batches[3 * e:3 * e + 3] for i in b]
        assert len(set(epoch)) == 9 and set(epoch) <= set(range(10))  # 9 distinct rows, one dropped
        # exactly the documented derivation: the first 9 of the (seed, epoch) permutation
        assert epoch == np.random.default_rng([7, e]).permutation(10)[:9].tolist()
    assert batches[:3] != batches[3:6]
    assert take(ShuffledSampler(10, 3, seed=7), 9) == batches  # deterministic
    assert take(ShuffledSampler(10, 3, seed=8), 9) != batches
    exact = take(ShuffledSampler(10, 5, seed=7), 4)  # batch size divides: every row in every epoch
    assert sorted(exact[0] + exact[1]) == sorted(exact[2] + exact[3]) == list(range(10))


def test_sampler_without_shuffle():
    s = ShuffledSampler(7, 3, seed=1, shuffle=False)
    assert take(s, 5) == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]


@pytest.mark.parametrize("consumed", [4, 3, 6, 0])  # mid-epoch, at the end of epoch 0 and 1, fresh
def test_sampler_resume_continues_identically(consumed):
    reference = take(ShuffledSampler(10, 3, seed=5), consumed + 8)
    first = ShuffledSampler(10, 3, seed=5)
    take(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert {"epoch", "index", "seed"} <= set(state)
    if consumed == 3:
        assert (state["epoch"], state["index"]) == (0, 9)
    resumed = ShuffledSampler(10, 3, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 8) == reference[consumed:]


def test_sampler_refusals():
    state = ShuffledSampler(10, 3, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed=1 but this run has seed=2"):
        ShuffledSampler(10, 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"num_rows=10 but this run has num_rows=11"):
        ShuffledSampler(11, 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"shuffle=1 but this run has shuffle=0"):
        ShuffledSampler(10, 3, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_size=11 is larger than the dataset \(10 rows\)"):
        ShuffledSampler(10, 11, seed=1)


def test_iterate_batches_keeps_every_row(tok):
    assert list(iterate_batches(list(range(10)), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    ds = PromptDataset([str(VAL)], tok)
    batches = list(iterate_batches(ds, 64))
    assert [len(b) for b in batches] == [64, 64, 64, 8]
    assert [r.index for b in batches for r in b] == list(range(200))
