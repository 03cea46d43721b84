"""The offline models and data the tests and the demo run on (`make models data`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ARITH, PYTHON, REPO, SMOLLM2, TINY_MODEL, run
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

TINY_QWEN3 = REPO / "models" / "tiny-qwen3"
TINY_QWEN3_MOE = REPO / "models" / "tiny-qwen3-moe"
TINY = {"qwen2": TINY_MODEL, "qwen3": TINY_QWEN3, "qwen3-moe": TINY_QWEN3_MOE}


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


@pytest.mark.parametrize("family", list(TINY))
def test_tiny_model_build_is_deterministic_and_cached(tmp_path, family: str) -> None:
    """A second build, here in this process (`make models` built the first in its own: a fresh interpreter
    importing torch and transformers costs ~4 CPU-s a family), gives the same bytes; the command then
    finds it up to date."""
    out = tmp_path / "tiny"
    tool_args = ["--out", str(out)] + ([] if family == "qwen2" else ["--family", family])  # qwen2: the default
    assert load_tool().main(tool_args) == 0
    assert sha256(out / "model.safetensors") == sha256(TINY[family] / "model.safetensors")
    assert sha256(out / "tokenizer.json") == sha256(TINY[family] / "tokenizer.json")
    assert json.loads((out / ".hpcrl-build.json").read_text())["family"] == family
    again = run([PYTHON, "tools/make_tiny_model.py", *tool_args], timeout=60)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert not (tmp_path / "tiny.tmp").exists()


def load_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_model_stamp_names_the_family(tmp_path) -> None:
    tool = load_tool()
    assert tool.RECIPE_VERSION == tool.FAMILIES["qwen2"]["recipe"] == 2
    stamp = tmp_path / tool.STAMP
    stamp.write_text(json.dumps({"recipe": 2, "hidden": 128, "params": 558208}))  # written before families
    assert tool.is_built(tmp_path, 128) and tool.is_built(tmp_path, 128, "qwen2")
    assert not tool.is_built(tmp_path, 128, "qwen3") and not tool.is_built(tmp_path, 64)
    stamp.write_text(json.dumps({"recipe": tool.FAMILIES["qwen3"]["recipe"], "hidden": 128, "family": "qwen3"}))
    assert tool.is_built(tmp_path, 128, "qwen3")
    assert not tool.is_built(tmp_path, 128) and not tool.is_built(tmp_path, 128, "qwen3-moe")


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_tiny_qwen3_shapes_norms_and_shared_tokenizer(family: str) -> None:
    path = TINY[family]
    cfg = json.loads((path / "config.json").read_text())
    moe = family == "qwen3-moe"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 4, 2)
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]) == (128, 32, 512)
    assert cfg["max_position_embeddings"] == 4096 and cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is (not moe)
    if moe:  # the hub's key names: the expert count, and one set of tensors per expert
        assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 2, 64)
        assert cfg["norm_topk_prob"] is True and cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
        assert "num_local_experts" not in cfg
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
        assert {f"model.layers.3.mlp.experts.7.{w}_proj.weight" for w in ("gate", "up", "down")} <= keys
        assert "model.layers.0.mlp.gate.weight" in keys and "lm_head.weight" in keys
        assert not any("gate_up_proj" in k for k in keys)
    # one tokenizer for every family
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).read_bytes() == (TINY_MODEL / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is None
    # every norm perturbed away from ones, so a conversion that drops one changes the logits
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert len(norms) == 4 * 4 + 1
    for n, p in norms.items():
        assert 0.02 < (p - 1).abs().mean() < 0.2, n
    ids = torch.randint(3, cfg["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_router_logits=moe)
    assert out.logits.shape == (1, 24, cfg["vocab_size"]) and torch.isfinite(out.logits).all()
    if moe:  # a decisive router: the 3rd choice is clearly behind the top 2 for most tokens
        top = torch.cat(out.router_logits).topk(3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).median() > 0.1


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
