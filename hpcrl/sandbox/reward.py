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
  - ["assert f(2) == 4", ...]                   assert (and import) statements (MBPP style)
Outputs are compared line by line with trailing whitespace and blank edge lines ignored. Assert
cases are judged in a process apart from the solution's (hpcrl/sandbox/asserts.py): the solution's
run only computes the values the asserts need (`f(2)`), a harness run compares them strictly.

Any limit hit (time, CPU, memory, processes, file size, output) scores the whole sample 0. The
function never raises for a program's behaviour; a malformed ground truth raises ValueError, which
the reward worker scores 0 and counts in reward/errors.

The sample's runs end within `total_timeout_s` (default 8 s) and, in a reward worker, within the
scorer's `reward.timeout_s` less a margin (each run's wall limit is cut to the time left), so the
scorer does not kill the worker mid-sample. Programs hide the trainer's working folder, $HOME, and
the run's data folders and run directory (`default_hidden_paths`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hpcrl.sandbox.asserts import harness_program, plan_case, read_values, read_verdicts, server_program
from hpcrl.sandbox.config import SandboxConfig
from hpcrl.sandbox.runner import ProgramJob, Sandbox, SandboxResult

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# Never hidden: system folders.
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


def _passed_io(case: CodeTestCase, r: SandboxResult) -> bool:
    return r.ok and normalize_output(r.stdout) == normalize_output(case.output)


# Where the controller keeps what programs must not read, beyond the working folder and $HOME: set by
# `hide_run_paths_from_programs` in the controller, inherited by the reward workers' environment.
HIDDEN_PATHS_ENV = "HPCRL_SANDBOX_HIDDEN_PATHS"


def default_hidden_paths() -> tuple[str, ...]:
    """What every sandboxed program of a run is kept from: the folder the trainer runs from (data/,
    runs/), $HOME (keys, caches), and the run's data folders and run directory when the controller
    named them (HIDDEN_PATHS_ENV). System folders are never hidden; an interpreter that lives inside a
    hidden folder (a venv in the project, conda under $HOME) is bound back read-only by the sandbox."""
    found = {os.path.realpath(os.getcwd()), os.path.realpath(os.path.expanduser("~"))}
    found |= {os.path.realpath(p) for p in os.environ.get(HIDDEN_PATHS_ENV, "").split(os.pathsep) if p}
    return tuple(sorted(p for p in found if p not in _NEVER_HIDE and not any(_within(n, p) for n in _NEVER_HIDE[1:])))


def run_hidden_paths(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """A run's folders that hold answers or its state, from its config (a plain dict): the folder of
    every `data.*_files` entry and `trainer.run_dir`."""
    out = set()
    for key, value in (cfg.get("data") or {}).items():
        if key.endswith("_files") and value:
            for f in [value] if isinstance(value, str) else value:
                out.add(os.path.dirname(os.path.abspath(str(f))))
    run_dir = (cfg.get("trainer") or {}).get("run_dir")
    if run_dir:
        out.add(os.path.abspath(str(run_dir)))
    return tuple(sorted(out))


def hide_run_paths_from_programs(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """In the controller, before tools and reward workers start: every sandbox of the run (the python
    tool, the code reward in the workers, which inherit the environment) hides the run's data folders
    and run directory on top of the defaults. Returns what is now hidden."""
    paths = run_hidden_paths(cfg)
    os.environ[HIDDEN_PATHS_ENV] = os.pathsep.join(paths)
    return default_hidden_paths()


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _with_default_hidden(config: SandboxConfig) -> SandboxConfig:
    return replace(config, hidden_paths=tuple(sorted({*config.hidden_paths, *default_hidden_paths()})))


def _deadline(total_timeout_s: float) -> float:
    """When this sample's reward must be done: total_timeout_s from now, and inside the scorer's own
    per-sample timeout when running in a reward worker (a margin for what follows the last run)."""
    from hpcrl.rewards.worker import sample_deadline

    end = time.monotonic() + total_timeout_s
    scorer_end = sample_deadline()
    if scorer_end is not None:
        end = min(end, scorer_end - _MARGIN_S - 0.05 * (scorer_end - time.monotonic()))
    return end


_MARGIN_S = 1.0
_MIN_RUN_S = 0.05  # less time than this left: the case is not started (a time limit hit)


def _capped(config: SandboxConfig, end: float) -> SandboxConfig | None:
    left = end - time.monotonic()
    if left < _MIN_RUN_S:
        return None
    return replace(config, wall_s=min(config.wall_s, left)) if left < config.wall_s else config


def _run_io(box: Sandbox, program: str, cases: list[CodeTestCase], end: float,
            all_or_nothing: bool) -> tuple[int, bool]:
    """(cases passed, a limit was hit) for stdin/stdout cases."""
    passed = 0
    for start in range(0, len(cases), box.max_concurrency):
        config = _capped(box.config, end)
        if config is None:
            return passed, True
        batch = cases[start:start + box.max_concurrency]
        results = box.run_many([ProgramJob(program, stdin=c.input) for c in batch], config)
        if any(r.limit is not None for r in results):
            return passed, True
        ok = [_passed_io(c, r) for c, r in zip(batch, results)]
        passed += sum(ok)
        if all_or_nothing and not all(ok):
            break
    return passed, False


def _run_asserts(box: Sandbox, program: str, cases: list[CodeTestCase], end: float,
                 all_or_nothing: bool) -> tuple[int, bool]:
    """(cases passed, a limit was hit) for assert cases: the solution's runs give values, one harness
    run judges them (hpcrl.sandbox.asserts)."""
    plans = [plan_case(c.statement) for c in cases]
    values: list[list | None] = []
    for start in range(0, len(plans), box.max_concurrency):
        config = _capped(box.config, end)
        if config is None:
            return 0, True
        batch = plans[start:start + box.max_concurrency]
        jobs = [server_program(program, p) for p in batch]
        results = box.run_many([ProgramJob(src) for src, _ in jobs], config)
        if any(r.limit is not None for r in results):
            return 0, True
        got = [read_values(r.stdout, nonce, len(p.units)) if r.ok else None
               for (_, nonce), p, r in zip(jobs, batch, results)]
        values += got
        if all_or_nothing and any(v is None for v in got):
            return 0, False
    config = _capped(box.config, end)
    if config is None:
        return 0, True
    judged = box.run(harness_program(plans), stdin=json.dumps(values), config=config)
    if judged.limit is not None:
        return 0, True
    if not judged.ok:
        raise ValueError(f"the assert harness failed: {judged.error or judged.stderr[-300:]}")
    return sum(read_verdicts(judged.stdout, len(plans))), False


def make_code_reward(config: SandboxConfig | None = None, *, all_or_nothing: bool = False,
                     max_concurrency: int | None = None, total_timeout_s: float = 8.0) -> Callable[..., dict]:
    """A reward function fn(data_source, solution_str, ground_truth, extra_info=None) -> dict that runs
    the response's program against the sample's test cases in a `Sandbox(config)` (made at the first
    call, in the reward worker; `default_hidden_paths()` are hidden on top of config.hidden_paths).
    Returns {"score", "acc" (all passed), "format" (a program was found), "pass_rate", "tests",
    "limit_hit"}. Cases run `max_concurrency` at a time; in all-or-nothing mode the remaining batches
    are skipped after the first failure. The sample's time is total_timeout_s, and inside a reward
    worker also the scorer's reward.timeout_s less a margin: every run's wall limit is cut to what is
    left, and cases not run in time count as a time limit hit."""
    lock = threading.Lock()
    holder: dict[str, Sandbox] = {}

    def sandbox() -> Sandbox:
        with lock:
            if "box" not in holder:
                cfg = _with_default_hidden(config or SandboxConfig(wall_s=4.0, cpu_s=2.0))
                holder["box"] = Sandbox(cfg, max_concurrency=max_concurrency)
            return holder["box"]

    def code_reward(data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict | None = None) -> dict[str, float]:
        end = _deadline(total_timeout_s)
        cases = parse_test_cases(ground_truth, extra_info)
        program = extract_program(solution_str)
        out = {"score": 0.0, "acc": 0.0, "format": 0.0, "pass_rate": 0.0, "tests": float(len(cases)),
               "limit_hit": 0.0}
        if program is None:
            return out
        out["format"] = 1.0
        box = sandbox()
        run = _run_asserts if cases[0].kind == "assert" else _run_io
        passed, limit_hit = run(box, program, cases, end, all_or_nothing)
        if limit_hit:
            out["limit_hit"] = 1.0
            return out
        out["pass_rate"] = passed / len(cases)
        out["acc"] = 1.0 if passed == len(cases) else 0.0
        out["score"] = out["acc"] if all_or_nothing else out["pass_rate"]
        return out

    return code_reward


fraction_passed = make_code_reward()
all_passed = make_code_reward(all_or_nothing=True)
