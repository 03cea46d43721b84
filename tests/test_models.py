"""The offline models and data the tests and the demo run on (`make models data`)."""

from __future__ import annotations

import hashlib
import json
import re

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ARITH, PYTHON, SMOLLM2, TINY_MODEL, run
from transformers import AutoModelForCausalLM, AutoTokenizer


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_shape_and_chat_template() -> None:
    cfg = json.loads((TINY_MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (2, 4, 2)
    assert cfg["tie_word_embeddings"] is True
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's qkv bias
    out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), cfg["vocab_size"]) and torch.isfinite(out).all()


def test_tiny_model_build_is_deterministic_and_cached(tmp_path) -> None:
    out = tmp_path / "tiny"
    r = run([PYTHON, "tools/make_tiny_model.py", "--out", str(out)], timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sha256(out / "model.safetensors") == sha256(TINY_MODEL / "model.safetensors")
    assert sha256(out / "tokenizer.json") == sha256(TINY_MODEL / "tokenizer.json")
    again = run([PYTHON, "tools/make_tiny_model.py", "--out", str(out)], timeout=60)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert not (tmp_path / "tiny.tmp").exists()


def test_smollm2_is_a_real_trained_model() -> None:
    cfg = json.loads((SMOLLM2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    # A dequantized trained model predicts English; a broken conversion (random or scrambled
    # weights) sits near log(49152) = 10.8 nats per token.
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 3.0, f"SmolLM2 loss {loss:.2f} nats/token: the GGUF conversion is broken"
    msgs = [{"role": "user", "content": "What is 12 + 7?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=24, do_sample=False)
    answer = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert re.search(r"\d", answer), answer


def test_arith_data_schema_and_answers() -> None:
    for split, n in (("train", 2000), ("val", 200)):
        rows = pq.read_table(ARITH / f"{split}.parquet").to_pylist()
        assert len(rows) == n
        for i, row in enumerate(rows[:300]):
            assert row["data_source"] == "hpcrl/arith" and row["extra_info"]["index"] == i
            assert row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
            work, final = row["extra_info"]["answer"].split("\n#### ")
            lhs, rhs = work.split(" = ")
            a, op, b = lhs.split()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(rhs) == int(final)
            assert row["reward_model"] == {"style": "rule", "ground_truth": final}
    train_q = {r["extra_info"]["question"] for r in pq.read_table(ARITH / "train.parquet").to_pylist()}
    assert len(train_q) > 1500  # varied, not one template repeated
