"""Build the tiny random Qwen2 causal LM + byte-level BPE tokenizer used by tests, fully offline.

2 layers, 4 query heads / 2 KV heads (GQA, so TP=2 splits both), hidden 128, tied embeddings,
qkv bias: small enough for multi-rank CPU tests, shaped like the real Qwen2 family. Deterministic
(fixed seeds) and cached: a folder that already holds a complete build is left alone.

    python tools/make_tiny_model.py [--out models/tiny-qwen2] [--hidden 128] [--force]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

STAMP = ".hpcrl-build.json"
RECIPE_VERSION = 2  # 2: max_position_embeddings 4096 (long-sequence tests)


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


def build(out: Path, hidden: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    random.seed(0)
    torch.manual_seed(0)
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
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(tmp)

    cfg = Qwen2Config(vocab_size=len(hf_tok), hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      eos_token_id=hf_tok.eos_token_id, bos_token_id=hf_tok.pad_token_id,
                      pad_token_id=hf_tok.pad_token_id, torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    (tmp / STAMP).write_text(json.dumps({"recipe": RECIPE_VERSION, "hidden": hidden, "params": n}))
    # a half-written folder is never taken for a model: build beside it, then swap in
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"[tiny-model] built {out}: vocab={len(hf_tok)} params={n / 1e6:.2f}M", flush=True)


def is_built(out: Path, hidden: int) -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return stamp.get("recipe") == RECIPE_VERSION and stamp.get("hidden") == hidden


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/tiny-qwen2")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if is_built(out, args.hidden) and not args.force:
        print(f"[tiny-model] {out} is up to date", flush=True)
        return 0
    t0 = time.time()
    build(out, args.hidden)
    print(f"[tiny-model] done in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
