"""Quiet terminal, full logs: what a rank's output capture shows and keeps, which log records reach the
terminal, the per-step line, progress lines for long phases, and the metric helpers. Unit-sized: the
end-to-end checks of a real run are in tests/test_train.py (the `ppo` run)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO

# A rank as the entry makes it: its output captured, then library output, a child process, hpcrl's
# own lines, and optionally a crash. stderr_log is loaded by path: it is stdlib-only, and a plain
# `import hpcrl.controller` would cost seconds of torch.
RANK = textwrap.dedent("""
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("stderr_log", {path!r})
    capture = importlib.util.module_from_spec(spec)
    sys.modules["stderr_log"] = capture
    spec.loader.exec_module(capture)
    assert capture.start_capture(sys.argv[1], quiet=sys.argv[2] == "quiet", label="rank 3 nodeX")
    print("vllm says hello on stdout")
    print("torch warns on stderr", file=sys.stderr)
    os.system("echo child-out; echo child-err >&2")
    print("hpcrl step line", file=capture.terminal())
    print("hpcrl error line", file=capture.terminal(err=True))
    if sys.argv[3] == "crash":
        import ctypes, faulthandler
        faulthandler.enable()
        time.sleep(0.2)  # the lines above reach the child before the crash's
        ctypes.string_at(0)
""").format(path=str(REPO / "hpcrl" / "controller" / "stderr_log.py"))


def _rank(tmp_path: Path, mode: str, end: str = "clean") -> tuple[subprocess.CompletedProcess, str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    log = tmp_path / f"{mode}.log"
    r = subprocess.run([sys.executable, str(script), str(log), mode, end], capture_output=True, text=True,
                       timeout=60)
    deadline = time.monotonic() + 10  # the copier writes its exit line after the rank is gone
    while "[hpcrl stderr] exit" not in (text := log.read_text(errors="replace")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return r, text


LIBRARY = ("vllm says hello on stdout", "torch warns on stderr", "child-out", "child-err")


def test_quiet_rank_terminal_shows_hpcrl_lines_and_the_file_gets_everything(tmp_path: Path) -> None:
    r, text = _rank(tmp_path, "quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "hpcrl step line\n" and r.stderr == "hpcrl error line\n", (r.stdout, r.stderr)
    for line in (*LIBRARY, "hpcrl step line", "hpcrl error line"):
        assert f"\n{line}\n" in text, text  # each on its own line: stdout and stderr never share one
    assert text.startswith("[hpcrl stderr] start pid=") and "[hpcrl stderr] exit pid=" in text


def test_verbose_rank_terminal_shows_everything(tmp_path: Path) -> None:
    r, text = _rank(tmp_path, "verbose")
    assert r.returncode == 0, r.stderr
    for line in ("vllm says hello on stdout", "child-out", "hpcrl step line"):
        assert line in r.stdout
    for line in ("torch warns on stderr", "child-err", "hpcrl error line"):
        assert line in r.stderr
    assert all(line in text for line in LIBRARY)


def test_quiet_rank_crash_reaches_the_terminal_with_the_rank_named(tmp_path: Path) -> None:
    """A death from C (faulthandler's dump after SIGSEGV) is an error the terminal must show, named."""
    from hpcrl.controller.stderr_log import read_section

    r, text = _rank(tmp_path, "quiet", "crash")
    assert r.returncode != 0
    assert "[rank 3 nodeX] Fatal Python error: Segmentation fault" in r.stderr, r.stderr
    assert "[rank 3 nodeX]   File " in r.stderr and "torch warns on stderr" not in r.stderr, r.stderr
    pid = int(text.split("start pid=", 1)[1].split()[0])
    section = read_section(str(tmp_path / "quiet.log"), pid)
    assert section.exited_at is not None and "Fatal Python error: Segmentation fault" in section.text
    assert all(line in section.text for line in LIBRARY)


def test_terminal_filter_keeps_hpcrl_records_and_errors() -> None:
    from hpcrl.controller.console import FileOnlyFilter, TerminalFilter

    def rec(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    shown = TerminalFilter()
    assert shown.filter(rec("hpcrl.trainer", logging.INFO)) and shown.filter(rec("hpcrl", logging.WARNING))
    assert shown.filter(rec("vllm.engine", logging.ERROR)) and shown.filter(rec("py.warnings", logging.CRITICAL))
    assert not shown.filter(rec("vllm.engine", logging.WARNING)) and not shown.filter(rec("hpcrlx", logging.INFO))
    assert not shown.filter(rec("py.warnings", logging.WARNING))
    assert FileOnlyFilter().filter(rec("transformers", logging.WARNING))
    assert not FileOnlyFilter().filter(rec("hpcrl.engines", logging.WARNING))


def test_step_line_names_the_kl_it_shows() -> None:
    from hpcrl.trainer.metrics import progress_line

    grpo = {"reward/mean": 0.5, "actor/ppo_kl": -0.0012, "actor/entropy": 2.5, "time/step": 4.2,
            "throughput/tokens_per_s": 812.0}
    line = progress_line(3, 10, grpo, eta_s=30)
    assert line == "step 3/10 | reward 0.500 | ppo_kl -0.0012 | entropy 2.500 | time 4.2s | tok/s 812 | ETA 30 s"
    with_reference = {**grpo, "actor/kl": 0.02}
    assert " | kl +0.0200 | " in progress_line(3, 10, with_reference) and "ppo_kl" not in progress_line(
        3, 10, with_reference)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_for_a_long_phase() -> None:
    from hpcrl.trainer.progress import PhaseProgress

    clock, lines = FakeClock(), []
    p = PhaseProgress(lines.append, first_after_s=30, every_s=60, clock=clock)
    p.context = "step 1/5"
    p.begin("update_actor")
    clock.now += 20
    assert p.due_line() is None  # short phases stay silent
    clock.now += 15
    assert p.due_line() == "step 1/5: update_actor 35 s | first time: no pace yet"
    clock.now += 30
    assert p.due_line() is None  # the next one after every_s
    clock.now += 40
    p.end()
    assert lines == ["step 1/5: update_actor done in 1m45s"]
    p.learn_step({"throughput/update_actor_tokens_per_s": 9420.0, "time/update_actor": 105.0})
    p.context = "step 2/5"
    p.begin("update_actor")
    clock.now += 40
    assert p.due_line() == "step 2/5: update_actor 40 s | last time 1m45s at 9420 tok/s | ETA 1m05s"
    clock.now += 70
    assert p.due_line() == "step 2/5: update_actor 1m50s | last time 1m45s at 9420 tok/s | past the last time's length"
    p.end()
    # a phase that says how far it is (validation, batch by batch on the controller)
    p.begin("validate")
    clock.now += 45
    p.advance(96, work=256, unit="prompts")
    assert p.due_line() == "step 2/5: validate 45 s | 96/256 prompts at 2.13 prompts/s | ETA 1m15s"
    p.end()
    quiet = PhaseProgress(lines.append, first_after_s=0, every_s=0, clock=clock)  # logging.progress_every_s=0
    quiet.begin("generate")
    clock.now += 1000
    assert quiet.due_line() is None


def test_step_metric_helpers() -> None:
    import torch

    from hpcrl.trainer.metrics import distribution_metrics, peak_memory_metrics, per_source_metrics, phase_throughput

    mem = peak_memory_metrics([{"rss_gb": 1.0}, {"rss_gb": 3.0}], ranks=[1, 2])
    assert mem == {"memory/rank1/rss_gb": 1.0, "memory/rank2/rss_gb": 3.0, "memory/rss_gb_max": 3.0,
                   "memory/rss_gb_mean": 2.0}
    adv = distribution_metrics("advantages", torch.tensor([[1.0, 5.0], [-1.0, 9.0]]), torch.tensor([[1, 0], [1, 0]]))
    assert adv == {"advantages/mean": 0.0, "advantages/std": pytest.approx(2 ** 0.5), "advantages/min": -1.0,
                   "advantages/max": 1.0}
    src = per_source_metrics("reward_by_source", torch.tensor([1.0, 0.0, 0.5]), ["gsm8k", "math", "gsm8k"])
    assert src == {"reward_by_source/gsm8k/mean": 0.75, "reward_by_source/gsm8k/std": pytest.approx(0.3536, abs=1e-4),
                   "reward_by_source/math/mean": 0.0, "reward_by_source/math/std": 0.0}
    tput = phase_throughput({"generate": 2.0, "update_actor": 4.0}, {"generate": 100.0, "update_actor": 800.0,
                                                                      "values": 800.0})
    assert tput == {"throughput/generate_tokens_per_s": 50.0, "throughput/update_actor_tokens_per_s": 200.0}
