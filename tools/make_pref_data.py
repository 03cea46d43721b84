"""Generate a tiny preference set that the tiny random model can learn with DPO, offline, in TRL's schema.

Each pair asks for a short string of symbols; the chosen response is N digits, the rejected one N
lowercase letters (the tiny tokenizer spells both about one character per token, so the two
responses of a pair have nearly the same number of tokens and a random model has no length
preference between them: it ranks 52% of the held-out pairs right).
"Digits rather than letters" is a property a 0.56M-parameter model picks up within a few DPO steps
and that carries over to held-out pairs (new prompts, new strings), so preference accuracy on the
held-out split measures learning (tests/test_dpo.py). The train split is conversational (prompt
as chat messages, chosen / rejected as one assistant turn each), the held-out split plain text:
the two forms of the schema (hpcrl/data/preference.py). Deterministic for a seed; cached: existing
files with the same recipe are kept.

    python tools/make_pref_data.py [--out data/pref] [--train 1024] [--val 64]
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

from make_arith_data import write  # same folder: the atomic parquet / jsonl writer

TEMPLATES = ["Reply with {n} symbols.", "Write a code of {n} characters.", "Give me {n} signs, nothing else.",
             "Make up a tag of length {n}.", "Type {n} marks for label {k}."]


def pair(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, chosen, rejected): N digits are preferred over N letters."""
    n = rng.randint(4, 10)
    prompt = rng.choice(TEMPLATES).format(n=n, k=rng.randint(1, 99))
    chosen = "".join(rng.choice(string.digits) for _ in range(n))
    rejected = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
    return prompt, chosen, rejected


def rows(split: str, count: int, seed: int, conversational: bool) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    out = []
    for _ in range(count):
        prompt, chosen, rejected = pair(rng)
        if conversational:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/pref")
    ap.add_argument("--train", type=int, default=1024)
    ap.add_argument("--val", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    recipe = {"version": 1, **{k: getattr(args, k) for k in ("train", "val", "seed")}}
    stamp = out / ".hpcrl-build.json"
    outputs = {"train": out / "train.parquet", "val": out / "val.jsonl"}
    if (not args.force and stamp.is_file() and json.loads(stamp.read_text()) == recipe
            and all(p.is_file() for p in outputs.values())):
        print(f"[pref-data] {out} is up to date", flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", args.train), ("val", args.val)):
        path = outputs[split]
        write(path, rows(split, count, args.seed, conversational=split == "train"))
        print(f"[pref-data] wrote {path}: {count} pairs", flush=True)
    stamp.write_text(json.dumps(recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
