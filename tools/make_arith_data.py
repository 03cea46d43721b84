"""Generate arithmetic word problems with GSM8K-style answers, offline, in verl's schema.

Each row: data_source, prompt (chat messages), ability, reward_model {style, ground_truth},
extra_info {split, index, question, answer}. The answer text ends in '#### N' like GSM8K, and
ground_truth is N. Deterministic for a seed; cached: existing files with the same recipe are kept.

    python tools/make_arith_data.py [--out data/arith] [--train 2000] [--val 200] [--max-operand 20]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

DATA_SOURCE = "hpcrl/arith"
INSTRUCTION = "Solve the problem. Write the final answer as a number after '####'."
NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
ITEMS = ["apples", "books", "marbles", "stamps", "coins", "pencils", "shells", "cards"]


def problem(rng: random.Random, max_operand: int) -> tuple[str, str, int]:
    """(question, worked answer ending in '#### N', N)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        n, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        n, work = a - b, f"{a} - {b} = {a - b}"
    else:
        q = f"{name} buys {a} boxes with {b} {item} in each. How many {item} is that in total?"
        n, work = a * b, f"{a} * {b} = {a * b}"
    return q, f"{work}\n#### {n}", n


def rows(split: str, count: int, seed: int, max_operand: int) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    out = []
    for i in range(count):
        q, answer, n = problem(rng, max_operand)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(n)},
            "extra_info": {"split": split, "index": i, "question": q, "answer": answer},
        })
    return out


def write(path: Path, data: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".jsonl":
        tmp.write_text("".join(json.dumps(r) + "\n" for r in data))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(data), tmp)
    tmp.replace(path)  # atomic: a reader never sees half a file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/arith")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--val", type=int, default=200)
    ap.add_argument("--max-operand", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    recipe = {k: getattr(args, k) for k in ("train", "val", "max_operand", "seed", "format")}
    return build_splits(Path(args.out), recipe, args.force, "arith-data", "problems",
                        lambda split, count: rows(split, count, args.seed, args.max_operand))


def build_splits(out: Path, recipe: dict, force: bool, tag: str, unit: str,
                 make_rows: Callable[[str, int], list[dict]]) -> int:
    """Write out/{train,val}.{recipe['format']} with recipe['train'] / recipe['val'] rows, unless the
    stamp says the same recipe built them already (a deleted split is rebuilt, not reported up to date)."""
    stamp = out / ".hpcrl-build.json"
    outputs = [out / f"{split}.{recipe['format']}" for split in ("train", "val")]
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == recipe and all(p.is_file() for p in outputs):
        print(f"[{tag}] {out} is up to date", flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for path, split in zip(outputs, ("train", "val")):
        write(path, make_rows(split, recipe[split]))
        print(f"[{tag}] wrote {path}: {recipe[split]} {unit}", flush=True)
    stamp.write_text(json.dumps(recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
