"""Reward functions for tests/test_rewards.py, loaded by the scorer as `reward_fns:<name>` (tests/ is on
sys.path under pytest, and the scorer hands its sys.path to the workers).

`mixed` picks a behaviour by data_source so one batch can hold good, failing and hanging samples.
"""

from __future__ import annotations

import os
import sys
import time

NOT_A_FUNCTION = 42


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError(f"cannot score {solution_str!r}")


def sleeps(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float((extra_info or {}).get("sleep_s", 60)))
    return 1.0


def with_metrics(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5 + len(solution_str), "acc": 1.0, "length": len(solution_str), "note": "ignored"}


def environment(data_source, solution_str, ground_truth, extra_info=None):
    """What the worker process looks like from inside: its pid, whether torch or mpi4py got imported,
    and whether an MPI/PMI variable leaked in."""
    return {"score": 0.0, "pid": os.getpid(), "torch": "torch" in sys.modules, "mpi4py": "mpi4py" in sys.modules,
            "pmi_leaked": "PMI_RANK" in os.environ, "omp_threads": float(os.environ.get("OMP_NUM_THREADS", "0"))}


def bad_return(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": "high"} if data_source == "str" else (None if data_source == "none" else float("nan"))


def dies(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(3)


def mixed(data_source, solution_str, ground_truth, extra_info=None):
    return {"good": exact_match, "raise": raises, "sleep": sleeps, "dict": with_metrics,
            "die": dies}[data_source](data_source, solution_str, ground_truth, extra_info)


def two_args(data_source, solution_str):
    return 0.0


def digit_fraction_slower_after_a_restart(data_source, solution_str, ground_truth, extra_info=None):
    """hpcrl.rewards.toy.digit_fraction, 0.5 s later a sample in a Slurm job's first restart: the same
    rewards (so the same run as the reference), ~8 s a step (32 samples on 2 reward workers).
    tests/test_resume.py's USR1 + preemption test needs the restarted run still going when the preemption
    reaches it: the 8 steps left took ~4 s, twice in CI the run had ended first, and once here, with 2.4 s
    steps, Slurm's preemption signal had not come 14 s after the preempting job was submitted (the job
    ended TIMEOUT, not requeued). With ~48 s left the preemption lands mid-run, by its USR1 or at the end of
    the grace time."""
    from hpcrl.rewards.toy import digit_fraction

    if os.environ.get("SLURM_RESTART_COUNT") == "1":
        time.sleep(0.5)
    return digit_fraction(data_source, solution_str, ground_truth, extra_info)


def digit_fraction_slower_before_a_restart(data_source, solution_str, ground_truth, extra_info=None):
    """hpcrl.rewards.toy.digit_fraction, 0.5 s later a sample in a Slurm job's first run (no restart yet): the
    same rewards, ~8 s a step. tests/test_resume.py's FSDP test sends SIGUSR1 after step 1 and needs the run
    still going when it lands; slow steps that cost no CPU let the run be 6 steps instead of 20."""
    from hpcrl.rewards.toy import digit_fraction

    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        time.sleep(0.5)
    return digit_fraction(data_source, solution_str, ground_truth, extra_info)
