"""Build the tiny random causal LMs + byte-level BPE tokenizer used by tests, fully offline.

Four families, all with 4 query heads / 2 KV heads (GQA, so TP=2 splits both), hidden 128, head
dim 32, and the same tokenizer (built by the same code from the same corpus, so the vocab is
identical):

- qwen2 (models/tiny-qwen2): Qwen2ForCausalLM, 2 layers, qkv bias, tied embeddings.
- qwen3 (models/tiny-qwen3): Qwen3ForCausalLM, 4 layers, q_norm/k_norm, no qkv bias, tied embeddings.
- qwen3-moe (models/tiny-qwen3-moe): Qwen3MoeForCausalLM, 4 layers, every layer's MLP is 8 experts
  (moe_intermediate_size 64), top-2 routing with norm_topk_prob, untied lm_head.
- phi3 (models/tiny-phi3): Phi3ForCausalLM, 2 layers, fused qkv_proj and gate_up_proj, untied
  lm_head. A family the Megatron converter (hpcrl/engines/megatron/model.py read_arch) refuses: for
  the FSDP engine's tests. vLLM has its own Phi3 model. (OLMo2 was not used: vLLM 0.32 runs it
  through its Transformers backend, which patches transformers' Olmo2 classes in place and breaks a
  HF Olmo2 model in the same process, and hpcrl runs vLLM beside the trainer.)

Small enough for multi-rank CPU tests, shaped like the real families; fp32. For qwen3, qwen3-moe and
phi3 every norm weight is perturbed by 0.1 * randn after init (so a conversion that drops q_norm/k_norm
or a layer norm changes the logits), and the qwen3-moe router weights (`mlp.gate.weight`) are
scaled by 4 so routing is decisive (top-2 vs 3rd logit margins are not tiny); the build prints the
smallest such margin over a few random prompts.

Checkpoint layout of qwen3-moe: transformers 5.x holds each layer's experts fused in memory
(`mlp.experts.gate_up_proj` [E, 2*I, H], `mlp.experts.down_proj` [E, H, I]), but `save_pretrained`
writes the hub's per-expert keys (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), the
layout real Qwen3-MoE checkpoints have and the Megatron converter reads; the build checks that the
written safetensors has them and no fused keys. config.json names the expert count "num_experts"
as the hub's Qwen3-MoE configs do.

Deterministic (fixed seeds) and cached: a folder whose stamp (.hpcrl-build.json: family, recipe
version, hidden size) matches is left alone; a stamp without a family is a qwen2 build.

    python tools/make_tiny_model.py [--family qwen2|qwen3|qwen3-moe|phi3] [--out DIR] [--hidden 128] [--force]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

STAMP = ".hpcrl-build.json"
# Per family: the recipe version (bump it when the build changes, so cached folders rebuild) and
# the default output folder.
FAMILIES = {
    "qwen2": {"recipe": 2, "out": "models/tiny-qwen2"},  # 2: max_position_embeddings 4096 (long-sequence tests)
    "qwen3": {"recipe": 1, "out": "models/tiny-qwen3"},
    "qwen3-moe": {"recipe": 1, "out": "models/tiny-qwen3-moe"},
    "phi3": {"recipe": 1, "out": "models/tiny-phi3"},
}
RECIPE_VERSION = FAMILIES["qwen2"]["recipe"]


def corpus(n: int = 20000) -> list[str]:
    """Text the BPE merges are learned from: the arithmetic prompts the tests train on, plus chat markup."""
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, res = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        lines.append(f"Question: What is {a} {op} {b}? Let's think step by step. The answer is #### {res}")
    lines += ["user", "assistant", "system", "You are a helpful assistant.", "Answer with a number."] * 200
    return lines


def tokenizer():
    """The byte-level BPE tokenizer every family shares (vocab 512, Qwen chat markup)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", bos_token=None)
    hf_tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return hf_tok


def qwen2_model(hf_tok, hidden: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.pad_token_id,
                      pad_token_id=hf_tok.pad_token_id, torch_dtype="float32")
    return Qwen2ForCausalLM(cfg).to(torch.float32)


def qwen3_model(hf_tok, hidden: int, moe: bool):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=hidden * 4,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  max_position_embeddings=4096, rms_norm_eps=1e-6,
                  eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.pad_token_id,
                  pad_token_id=hf_tok.pad_token_id, dtype="float32")
    if moe:
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=hidden // 2, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                             tie_word_embeddings=False)
        model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True)).to(torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # input/post-attention/final norms and q_norm/k_norm: not all ones
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            if name.endswith("mlp.gate.weight"):  # the router: decisive top-2 choices
                p.mul_(4.0)
    return model


def perturb_norms(model, seed: int = 1) -> None:
    """Add 0.1 * randn to every norm weight, so a conversion that drops a norm changes the logits."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def phi3_model(hf_tok, hidden: int):
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=hidden * 4,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096, original_max_position_embeddings=4096,
                     tie_word_embeddings=False, rms_norm_eps=1e-6,
                     eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.pad_token_id,
                     pad_token_id=hf_tok.pad_token_id, dtype="float32")
    model = Phi3ForCausalLM(cfg).to(torch.float32)
    perturb_norms(model)  # input/post-attention norms and the final norm
    return model


def router_margin(model, vocab: int) -> float:
    """The smallest (2nd - 3rd largest) router logit over a few random prompts and every MoE layer."""
    import torch

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (4, 32), generator=g)
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    top = torch.cat([x.reshape(-1, x.shape[-1]) for x in logits]).topk(3, dim=-1).values
    return float((top[:, 1] - top[:, 2]).min())


def check_per_expert_keys(path: Path, layers: int, experts: int) -> None:
    """The saved checkpoint has the hub's per-expert keys, not the in-memory fused ones."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    want = {f"model.layers.{n}.mlp.experts.{e}.{w}_proj.weight"
            for n in range(layers) for e in range(experts) for w in ("gate", "up", "down")}
    fused = sorted(k for k in keys if "gate_up_proj" in k or k.endswith("experts.down_proj"))
    if not want <= keys or fused:
        raise SystemExit(f"[tiny-model] {path}: expected per-expert keys in model.safetensors; "
                         f"missing {sorted(want - keys)[:3]}, fused {fused[:3]}")


def build(out: Path, hidden: int, family: str = "qwen2") -> None:
    import torch

    random.seed(0)
    torch.manual_seed(0)
    hf_tok = tokenizer()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(tmp)

    if family == "qwen2":
        model = qwen2_model(hf_tok, hidden)
    elif family == "phi3":
        model = phi3_model(hf_tok, hidden)
    else:
        model = qwen3_model(hf_tok, hidden, moe=family == "qwen3-moe")
    model.save_pretrained(tmp, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    extra = ""
    if family == "qwen3-moe":
        cfg_path = tmp / "config.json"  # the hub's name for the expert count (transformers 5 writes its alias)
        cfg = json.loads(cfg_path.read_text())
        if "num_local_experts" in cfg:
            cfg["num_experts"] = cfg.pop("num_local_experts")
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        check_per_expert_keys(tmp, model.config.num_hidden_layers, model.config.num_experts)
        active = n - sum(p.numel() for name, p in model.named_parameters() if ".experts." in name) * 6 // 8
        extra = f" active={active / 1e6:.2f}M min-router-margin={router_margin(model, len(hf_tok)):.3f}"
    stamp = {"recipe": FAMILIES[family]["recipe"], "hidden": hidden, "params": n, "family": family}
    (tmp / STAMP).write_text(json.dumps(stamp))
    # a half-written folder is never taken for a model: build beside it, then swap in
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"[tiny-model] built {out} ({family}): vocab={len(hf_tok)} params={n / 1e6:.2f}M{extra}", flush=True)


def is_built(out: Path, hidden: int, family: str = "qwen2") -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (stamp.get("family", "qwen2") == family and stamp.get("recipe") == FAMILIES[family]["recipe"]
            and stamp.get("hidden") == hidden)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen2")
    ap.add_argument("--out", default=None, help="output folder (default: models/tiny-<family>)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    out = Path(args.out or FAMILIES[args.family]["out"])
    if is_built(out, args.hidden, args.family) and not args.force:
        print(f"[tiny-model] {out} is up to date", flush=True)
        return 0
    t0 = time.time()
    build(out, args.hidden, args.family)
    print(f"[tiny-model] done in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
