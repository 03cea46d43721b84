"""The code-execution reward: run the completion's program against the sample's test cases.

Use it as a custom reward (`hpcrl.rewards` loads it in its worker processes like any other):

    reward.function=hpcrl.sandbox.reward:fraction_passed    # score = share of test cases passed
    reward.function=hpcrl.sandbox.reward:all_passed         # score = 1 only when every case passes

or build one with other limits in your own module: `my_reward = make_code_reward(SandboxConfig(cpu_s=2))`
and `reward.function=my_module:my_reward`.

The program is the last ```python fenced block of the response. Test cases come from
`extra_info["test_cases"]` when the row has it, else from the ground truth, as JSON in one of:
  - {"inputs": [...], "outputs": [...]}        stdin/stdout pairs (APPS/TACO style)
  - [{"input": "...", "output": "..."}, ...]   stdin/stdout pairs
  - ["assert f(2) == 4", ...]                   statements run after the program (MBPP style)
Outputs are compared line by line with trailing whitespace and blank edge lines ignored.

Any limit hit (time, CPU, memory, processes, file size, output) scores the whole sample 0. The
function never raises for a program's behaviour; a malformed ground truth raises ValueError, which
the reward worker scores 0 and counts in reward/errors.

Keep `reward.timeout_s` (the scorer's per-sample bound) above `total_timeout_s` (default 8 s): the
scorer otherwise kills the worker mid-sample and scores it 0 as a timeout.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcrl.sandbox.config import SandboxConfig
from hpcrl.sandbox.runner import ProgramJob, Sandbox, SandboxResult

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# Where the trainer was started holds data/ (the ground truths) and runs/; $HOME holds keys. Never
# hidden: anything an interpreter needs.
_NEVER_HIDE = ("/", "/usr", "/lib", "/lib64", "/bin", "/etc", "/dev", "/proc", "/sys", "/tmp")


@dataclass(frozen=True)
class CodeTestCase:
    """stdin/stdout pair (kind "io") or a statement run after the program (kind "assert")."""

    kind: str
    input: str = ""
    output: str = ""
    statement: str = ""


def extract_program(response: str) -> str | None:
    """The last complete ```python (or ```py) fenced block of a response, or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def _text(value: Any) -> str:
    if isinstance(value, list):  # some sets store multi-line input as a list of lines
        return "\n".join(str(v) for v in value)
    return str(value)


def parse_test_cases(ground_truth: str, extra_info: Mapping[str, Any] | None = None) -> list[CodeTestCase]:
    """The sample's test cases (formats in the module docstring); ValueError for anything else."""
    raw: Any = (extra_info or {}).get("test_cases", ground_truth)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"test cases are not JSON ({e}): {raw[:100]!r}") from e
    if isinstance(raw, Mapping) and "inputs" in raw and "outputs" in raw:
        if raw.get("fn_name"):
            raise ValueError(f"call-based test cases (fn_name={raw['fn_name']!r}) are not supported; give "
                             "stdin/stdout pairs or assert statements")
        if len(raw["inputs"]) != len(raw["outputs"]):
            raise ValueError(f"{len(raw['inputs'])} inputs but {len(raw['outputs'])} outputs")
        cases = [CodeTestCase("io", _text(i), _text(o)) for i, o in zip(raw["inputs"], raw["outputs"])]
    elif isinstance(raw, list) and all(isinstance(c, Mapping) and "input" in c and "output" in c for c in raw):
        cases = [CodeTestCase("io", _text(c["input"]), _text(c["output"])) for c in raw]
    elif isinstance(raw, list) and all(isinstance(c, str) for c in raw):
        cases = [CodeTestCase("assert", statement=c) for c in raw]
    else:
        raise ValueError(f"unknown test case format ({type(raw).__name__}); expected {{'inputs', 'outputs'}}, "
                         "a list of {'input', 'output'} or a list of assert statements")
    if not cases:
        raise ValueError("no test cases")
    return cases


def normalize_output(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def _job(program: str, case: CodeTestCase) -> tuple[ProgramJob, str | None]:
    """The program run for one case, and for assert cases the marker the run must print last: the
    statements ran to the end (a bare `sys.exit(0)` in the solution would otherwise pass them all)."""
    if case.kind == "io":
        return ProgramJob(program, stdin=case.input), None
    marker = f"hpcrl-tests-done-{secrets.token_hex(8)}"
    return ProgramJob(f"{program}\n\n{case.statement}\nprint({marker!r})\n"), marker


def _passed(case: CodeTestCase, marker: str | None, r: SandboxResult) -> bool:
    if not r.ok:
        return False
    if case.kind == "io":
        return normalize_output(r.stdout) == normalize_output(case.output)
    return r.stdout.rstrip("\n").rsplit("\n", 1)[-1] == marker


def default_hidden_paths() -> tuple[str, ...]:
    """The folder the trainer runs from and $HOME, unless they hold the system or the interpreter."""
    from hpcrl.sandbox.runner import default_python

    python = default_python()
    # the interpreter's path, where it really is, and (a venv) the environment it belongs to
    needed = {os.path.abspath(python), os.path.realpath(python)}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        needed |= {sys.prefix, sys.base_prefix}
    out = []
    for p in {os.path.realpath(os.getcwd()), os.path.realpath(os.path.expanduser("~"))}:
        if p in _NEVER_HIDE or any(_within(n, p) for n in (*_NEVER_HIDE[1:], *needed)):
            continue
        out.append(p)
    return tuple(sorted(out))


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def make_code_reward(config: SandboxConfig | None = None, *, all_or_nothing: bool = False,
                     max_concurrency: int | None = None, total_timeout_s: float = 8.0) -> Callable[..., dict]:
    """A reward function fn(data_source, solution_str, ground_truth, extra_info=None) -> dict that runs
    the response's program against the sample's test cases in a `Sandbox(config)` (made at the first
    call, in the reward worker). Returns {"score", "acc" (all passed), "format" (a program was found),
    "pass_rate", "tests", "limit_hit"}. Cases run `max_concurrency` at a time; in all-or-nothing mode
    the remaining batches are skipped after the first failure. Cases not run within total_timeout_s
    count as a time limit hit."""
    lock = threading.Lock()
    holder: dict[str, Sandbox] = {}

    def sandbox() -> Sandbox:
        with lock:
            if "box" not in holder:
                cfg = config or SandboxConfig(wall_s=4.0, cpu_s=2.0, hidden_paths=default_hidden_paths())
                holder["box"] = Sandbox(cfg, max_concurrency=max_concurrency)
            return holder["box"]

    def code_reward(data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict | None = None) -> dict[str, float]:
        cases = parse_test_cases(ground_truth, extra_info)
        program = extract_program(solution_str)
        out = {"score": 0.0, "acc": 0.0, "format": 0.0, "pass_rate": 0.0, "tests": float(len(cases)),
               "limit_hit": 0.0}
        if program is None:
            return out
        out["format"] = 1.0
        box = sandbox()
        end = time.monotonic() + total_timeout_s
        passed = 0
        for start in range(0, len(cases), box.max_concurrency):
            if time.monotonic() >= end:
                out["limit_hit"] = 1.0
                break
            batch = cases[start:start + box.max_concurrency]
            jobs = [_job(program, c) for c in batch]
            results = box.run_many([j for j, _ in jobs])
            if any(r.limit is not None for r in results):
                out["limit_hit"] = 1.0
                break
            ok = [_passed(c, marker, r) for c, (_, marker), r in zip(batch, jobs, results)]
            passed += sum(ok)
            if all_or_nothing and not all(ok):
                break
        if out["limit_hit"]:
            return out
        out["pass_rate"] = passed / len(cases)
        out["acc"] = 1.0 if passed == len(cases) else 0.0
        out["score"] = out["acc"] if all_or_nothing else out["pass_rate"]
        return out

    return code_reward


fraction_passed = make_code_reward()
all_passed = make_code_reward(all_or_nothing=True)
