"""Megatron-core roles behind the controller runtime, against HF transformers.

One world of 1 controller + N workers (4 CPU workers with gloo by default; on a GPU machine
tools/gpu_smoke.sh sets HPCRL_TEST_WORKERS to the GPU count) runs every scenario
(tests/programs/megatron_checks.py); the tests assert on what it measured.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import PYTHON, run

from hpcrl.launch import entry_argv, mpiexec_command

WORKERS = int(os.environ.get("HPCRL_TEST_WORKERS", "4"))
LAYOUTS = [f"{tp}x{pp}" for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)] if WORKERS % (tp * pp) == 0]


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("mcore") / "checks.json"
    cmd = mpiexec_command(WORKERS, entry_argv("tests/programs/megatron_checks.py", [str(out)], python=PYTHON))
    r = run(cmd, timeout=900)
    assert r.returncode == 0 and out.is_file(), f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_tiny_logprobs_match_hf_for_every_layout(checks: dict) -> None:
    assert sorted(checks["logprob_tiny"]) == sorted(LAYOUTS)
    for layout, r in checks["logprob_tiny"].items():
        tp, pp = map(int, layout.split("x"))
        assert r["max_abs"] < 1e-4, (layout, r)
        assert r["dp"] == WORKERS // (tp * pp)


def test_smollm2_logprobs_match_hf(checks: dict) -> None:
    assert sorted(checks["logprob_smollm2"]) == [x for x in sorted(LAYOUTS) if x.startswith("1x")]
    for layout, diff in checks["logprob_smollm2"].items():
        assert diff < 1e-4, (layout, diff)


def test_packed_and_padded_logprobs_agree(checks: dict) -> None:
    assert checks["packed_vs_padded"]["max_abs"] < 1e-5
    assert checks["packed_vs_padded"]["padded_vs_hf"] < 1e-4


@pytest.mark.parametrize("which", ["round_trip_tiny", "round_trip_smollm2"])
def test_hf_megatron_hf_round_trip_is_bit_exact(checks: dict, which: str) -> None:
    assert checks[which]["same_keys"] and checks[which]["bit_exact"]


def test_export_writes_a_sharded_hf_folder(checks: dict) -> None:
    pp = max(int(x.split("x")[1]) for x in LAYOUTS)
    shards = {f"model-{i:05d}-of-{pp:05d}.safetensors" for i in range(1, pp + 1)}
    assert shards | {"model.safetensors.index.json", "config.json", "tokenizer.json"} <= set(
        checks["round_trip_tiny"]["files"])


def test_update_is_the_same_at_tp2_pp2_and_tp1_pp1(checks: dict) -> None:
    small, big = checks["update_layouts"]
    assert big == LAYOUTS[-1]
    a, b = checks["update"][small], checks["update"][big]
    for key in ("loss", "pg_loss", "entropy", "ppo_kl", "grad_norm"):
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert a["optimizer_steps"] == b["optimizer_steps"] == 2
    w = checks["update_weights"]
    assert w["max_abs_change"] > 1e-6  # the weights really moved
    assert w["max_abs_diff"] < 1e-5


def test_critic_value_head_learns_returns(checks: dict) -> None:
    c = checks["critic"]
    assert c["v0_max_abs"] == 0.0  # a fresh value head, not the LM head
    assert min(c["losses"][1:]) < 0.1 * c["losses"][0]
    assert max(c["value_means"]) > 0.8  # moved from 0 towards the returns of 1


def test_cpu_path_uses_local_spec_and_gloo(checks: dict) -> None:
    if checks["cuda"]:
        assert checks["engine"]["backend"] == "nccl" and checks["engine"]["device"].startswith("cuda")
    else:
        assert checks["engine"] == {**checks["engine"], "spec": "local", "device": "cpu", "backend": "gloo"}


@pytest.mark.gpu
def test_gpu_path_uses_transformer_engine_and_nccl(checks: dict) -> None:
    assert checks["cuda"] and checks["engine"]["spec"] == "te" and checks["engine"]["backend"] == "nccl"


def test_reward_model_scores_match_hf(checks: dict) -> None:
    r = checks["reward_model"]
    assert r["n"] == 6 and r["spread"] > 1e-2, r  # the scores differ between sequences
    assert r["max_abs"] < 1e-4, r
