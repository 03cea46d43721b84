"""Generate small stdin/stdout programming tasks, offline, in verl's schema, for the code-execution
reward (`reward.function=hpcrl.sandbox.reward:fraction_passed`, which runs the response's last
```python block in the sandbox against the row's test cases).

Each row: data_source "hpcrl/code", prompt (chat messages), ability "code", reward_model
{style: "code", ground_truth: JSON {"inputs": [...], "outputs": [...]}} (APPS/TACO's stdin/stdout
form), extra_info {split, index, task, solution}: a reference program that passes every case
(tests/test_train.py checks that the sandbox scores it 1). Deterministic for a seed; cached like
tools/make_arith_data.py.

    python tools/make_code_data.py [--out data/code] [--train 64] [--val 16] [--cases 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

from make_arith_data import build_splits  # same folder: the cached, atomic writer

DATA_SOURCE = "hpcrl/code"
INSTRUCTION = ("Write a Python program that reads the input from standard input and prints the answer. "
               "Put the program in one ```python code block.")

# (task text, reference program, case generator: rng -> (stdin, expected stdout))
Task = tuple[str, str, Callable[[random.Random], tuple[str, str]]]


def _ints(rng: random.Random, k: int, lo: int = -50, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(k)]


def _words(rng: random.Random) -> list[str]:
    return ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]


def _sum2(rng: random.Random) -> tuple[str, str]:
    a, b = _ints(rng, 2)
    return f"{a} {b}\n", f"{a + b}\n"


def _max_list(rng: random.Random) -> tuple[str, str]:
    xs = _ints(rng, rng.randint(1, 6))
    return f"{len(xs)}\n{' '.join(map(str, xs))}\n", f"{max(xs)}\n"


def _reverse(rng: random.Random) -> tuple[str, str]:
    w = "".join(_words(rng))
    return f"{w}\n", f"{w[::-1]}\n"


def _vowels(rng: random.Random) -> tuple[str, str]:
    w = " ".join(_words(rng))
    return f"{w}\n", f"{sum(c in 'aeiou' for c in w)}\n"


def _factorial(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 10)
    f = 1
    for k in range(2, n + 1):
        f *= k
    return f"{n}\n", f"{f}\n"


def _sort_words(rng: random.Random) -> tuple[str, str]:
    ws = _words(rng)
    return f"{' '.join(ws)}\n", f"{' '.join(sorted(ws))}\n"


TASKS: list[Task] = [
    ("Read two integers on one line and print their sum.", "a, b = map(int, input().split())\nprint(a + b)\n",
     _sum2),
    ("The first line holds n, the second n integers. Print the largest of them.",
     "input()\nprint(max(map(int, input().split())))\n", _max_list),
    ("Read a word and print it reversed.", "print(input().strip()[::-1])\n", _reverse),
    ("Read a line and print how many of its characters are vowels (a, e, i, o, u).",
     "print(sum(c in 'aeiou' for c in input()))\n", _vowels),
    ("Read an integer n (0 <= n <= 10) and print n factorial.",
     "import math\nprint(math.factorial(int(input())))\n", _factorial),
    ("Read words separated by spaces and print them in alphabetical order, separated by spaces.",
     "print(' '.join(sorted(input().split())))\n", _sort_words),
]


def rows(split: str, count: int, seed: int, cases: int) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    out = []
    for i in range(count):
        text, solution, make_case = TASKS[i % len(TASKS)]
        pairs = [make_case(rng) for _ in range(cases)]
        tests = {"inputs": [p[0] for p in pairs], "outputs": [p[1] for p in pairs]}
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{text} {INSTRUCTION}"}],
            "ability": "code",
            "reward_model": {"style": "code", "ground_truth": json.dumps(tests)},
            "extra_info": {"split": split, "index": i, "task": text, "solution": solution},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/code")
    ap.add_argument("--train", type=int, default=64)
    ap.add_argument("--val", type=int, default=16)
    ap.add_argument("--cases", type=int, default=3, help="stdin/stdout test cases per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="jsonl")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    recipe = {k: getattr(args, k) for k in ("train", "val", "cases", "seed", "format")}
    return build_splits(Path(args.out), recipe, args.force, "code-data", "tasks",
                        lambda split, count: rows(split, count, args.seed, args.cases))


if __name__ == "__main__":
    sys.exit(main())
