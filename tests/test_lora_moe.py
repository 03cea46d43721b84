"""LoRA on Qwen3 and Qwen3-MoE: adapters on the attention (and a dense model's MLP), never on an MoE
model's experts or router; the PEFT export and merged weights against PEFT itself.

The engine checks run in a subprocess (tests/programs/lora_moe_checks.py: one 1-rank gloo world of
its own, so this process holds none); the target rules and the preflight run here.
"""

from __future__ import annotations

import json
import pickle
import subprocess

import pytest
import torch
from conftest import PYTHON, REPO

from hpcrl.cli import main as cli_main
from hpcrl.engines.megatron.lora import (
    ATTENTION,
    TARGETS,
    LoraSettings,
    Targets,
    _layer_kind,
    adapters_from_hf,
    adapters_to_hf,
    model_targets,
    resolve_targets,
)
from hpcrl.engines.megatron.model import read_arch

MOE = REPO / "models" / "tiny-qwen3-moe"
QWEN3 = REPO / "models" / "tiny-qwen3"
TINY_CFG = str(REPO / "configs" / "grpo_tiny.yaml")
TOL = 1e-4  # fp32
LAYERS = 4  # both tiny models
QKVO = ["k_proj", "o_proj", "q_proj", "v_proj"]
MLP_HF = ["down_proj", "gate_proj", "up_proj"]


# the rules, on plain names and tensors ---------------------------------------------------------
def test_all_linear_on_moe_means_the_attention() -> None:
    assert resolve_targets(["all-linear"], moe=True) == ATTENTION
    assert resolve_targets(["q_proj", "k_proj", "v_proj", "o_proj"], moe=True) == ATTENTION
    assert resolve_targets(["all-linear"]) == TARGETS  # dense: every linear layer, as before


@pytest.mark.parametrize("names", [["linear_fc1"], ["linear_fc2"], ["all-linear", "linear_fc1"],
                                   ["gate_proj", "up_proj"], ["q_proj", "k_proj", "v_proj", "down_proj"],
                                   ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]])
def test_mlp_targets_on_moe_are_refused_naming_the_key(names: list[str]) -> None:
    with pytest.raises(ValueError, match=r"^actor\.lora\.target_modules: .*LoRA on experts is not supported "
                                         r"\(attention only\)"):
        resolve_targets(names, moe=True)
    resolve_targets(names)  # a dense model takes them


def test_engine_side_targets_of_an_moe_model() -> None:
    """What the engine adapts from already-resolved targets (the workers resolve them without the
    model): all-linear's MLP layers dropped, named ones refused; a dense model keeps them all."""
    moe, dense = read_arch(MOE), read_arch(QWEN3)
    assert moe.is_moe and moe.qk_norm and dense.qk_norm and not dense.is_moe
    assert model_targets(resolve_targets(["all-linear"]), moe) == ATTENTION
    assert model_targets(TARGETS, moe) == ATTENTION  # LoraSettings' default: all linear layers
    assert model_targets(resolve_targets(["all-linear"]), dense) == TARGETS
    assert model_targets(resolve_targets(["linear_fc1"]), dense) == ("linear_fc1",)
    with pytest.raises(ValueError, match=r"actor\.lora\.target_modules: \['linear_fc1'\] are MLP layers"):
        model_targets(resolve_targets(["linear_qkv", "linear_fc1"]), moe)
    with pytest.raises(ValueError, match="LoRA on experts is not supported"):
        model_targets(("linear_fc2",), moe)
    # the flag survives pickling (settings may travel between processes)
    t = pickle.loads(pickle.dumps(LoraSettings(4, 8.0, targets=resolve_targets(["linear_fc1"])))).targets
    assert isinstance(t, Targets) and not t.all_linear and t == ("linear_fc1",)
    assert pickle.loads(pickle.dumps(resolve_targets(["all-linear"]))).all_linear


def test_only_a_layers_own_linear_layers_are_adaptable() -> None:
    assert _layer_kind("decoder.layers.3.self_attention.linear_qkv") == "linear_qkv"
    assert _layer_kind("decoder.layers.0.mlp.linear_fc2") == "linear_fc2"
    for name in ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1",
                 "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2", "decoder.layers.0.mlp.experts.linear_fc1",
                 "decoder.layers.0.mlp.router", "decoder.layers.0.self_attention.q_layernorm",
                 "decoder.layers.0.self_attention.k_layernorm", "decoder.layers.0.mlp.shared_experts.linear_fc1"):
        assert _layer_kind(name) is None, name


def test_expert_adapters_have_no_peft_name() -> None:
    arch = read_arch(MOE)
    key = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1"
    shard = {f"{key}.lora_A": torch.zeros(4, 128), f"{key}.lora_B": torch.zeros(128, 4)}
    with pytest.raises(ValueError, match="no PEFT name"):
        adapters_to_hf(arch, [shard], 0, 1)
    with pytest.raises(ValueError, match="LoRA on experts is not supported"):
        adapters_from_hf(arch, lambda n: torch.zeros(1), ("linear_qkv", "linear_fc1"), 0, 1, 0, 1)


# the preflight (`hpcrl config`: exit 2 naming the key) -------------------------------------------
@pytest.mark.parametrize("targets", ["[linear_fc1]", "[all-linear,down_proj]", "[gate_proj,up_proj]"])
def test_preflight_refuses_mlp_targets_on_an_moe_model(targets: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    status = cli_main(["config", TINY_CFG, f"model.path={MOE}", "actor.parallel.tensor_parallel=1",
                       "actor.ppo_mini_batch_size=8", "actor.lora.rank=8", f"actor.lora.target_modules={targets}"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err, (status, out[-500:], err)
    named = [line for line in err.splitlines() if line.startswith("  - actor.lora.target_modules")]
    assert len(named) == 1 and "LoRA on experts is not supported (attention only)" in named[0], err
    assert "8 experts per layer" in named[0], named


def test_preflight_takes_attention_targets_on_moe_and_mlp_on_dense(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    lora = ["actor.parallel.tensor_parallel=1", "actor.ppo_mini_batch_size=8", "actor.lora.rank=8"]
    for model, targets in ((MOE, "[all-linear]"), (MOE, "[q_proj,k_proj,v_proj,o_proj]"), (MOE, "[linear_proj]"),
                           (QWEN3, "[linear_fc1]"), (QWEN3, "[all-linear]")):
        status = cli_main(["config", TINY_CFG, f"model.path={model}", *lora, f"actor.lora.target_modules={targets}"])
        assert status == 0, (model, targets, capsys.readouterr().err)


# the engine against PEFT (subprocess) --------------------------------------------------------------
@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lora_moe") / "out.json"
    r = subprocess.run([PYTHON, str(REPO / "tests" / "programs" / "lora_moe_checks.py"), str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


def _expected(kinds: tuple[str, ...]) -> list[str]:
    block = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
    return sorted(f"decoder.layers.{i}.{block[k]}.{k}" for i in range(LAYERS) for k in kinds)


def test_moe_all_linear_adapts_attention_only(checks: dict) -> None:
    r = checks["qwen3-moe"]
    assert r["targets"] == ["linear_qkv", "linear_proj"]
    assert r["adapted"] == _expected(ATTENTION) and len(r["adapted"]) == 2 * LAYERS
    # the only trainable parameters, and the only adapters anywhere (none on experts or routers)
    lora = sorted(f"{n}.lora_{ab}" for n in r["adapted"] for ab in "AB")
    assert r["trainable"] == lora and r["lora_params_anywhere"] == lora


@pytest.mark.parametrize("model,kinds,hf_targets", [("qwen3-moe", ATTENTION, QKVO),
                                                    ("qwen3", TARGETS, sorted(QKVO + MLP_HF))])
def test_adapters_match_peft(checks: dict, model: str, kinds: tuple[str, ...], hf_targets: list[str]) -> None:
    """Random B: the engine's log-probs (adapters on), its merged weights (the reshard's) and the PEFT
    folder it writes all give PEFT's log-probs; the export names are PEFT's own for the model."""
    r = checks[model]
    assert r["adapted"] == _expected(kinds)
    assert r["exported_names"] == r["peft_names"], set(r["exported_names"]) ^ set(r["peft_names"])
    assert len(r["exported_names"]) == 2 * LAYERS * len(hf_targets)
    assert not any("norm" in n for n in r["exported_names"])  # q/k norms are no targets
    assert r["hf_targets"] == hf_targets and r["adapter_config_targets"] == hf_targets
    assert r["peft_unexpected"] == []
    assert r["adapters_move"] > 0.05  # the adapters matter at the tolerance below
    for key in ("base_vs_hf", "engine_vs_peft", "merged_vs_peft", "folder_vs_peft", "reloaded_vs_engine"):
        assert r[key] < TOL, (key, r[key])
    assert r["reloaded_same_names"] and r["reloaded_max_diff"] == 0.0


def test_moe_engine_refuses_explicit_mlp_targets_and_mlp_adapters(checks: dict) -> None:
    r = checks["qwen3-moe"]
    assert r["explicit_fc1_error"] is not None
    assert r["explicit_fc1_error"].startswith("actor.lora.target_modules: ['linear_fc1'] are MLP layers")
    assert "LoRA on experts is not supported (attention only)" in r["explicit_fc1_error"]
    assert r["mlp_folder_error"] is not None and "mlp.gate.lora_A" in r["mlp_folder_error"]
