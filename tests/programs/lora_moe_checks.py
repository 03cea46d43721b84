"""Driver of tests/test_lora_moe.py: LoRA on the tiny Qwen3 and Qwen3-MoE against PEFT, in one
1-rank gloo world of its own (this process; the pytest process keeps none).

    python tests/programs/lora_moe_checks.py OUT.json

Per model, with actor.lora.target_modules=[all-linear] (rank 4, alpha 8, fp32): the adapted layers;
lora_B set to seeded random values (lora_A is hpcrl's own draw); the engine's log-probs (adapters on
and off) against PEFT's on the HF model holding the exported adapters (`adapters_to_hf`); the merged
weights the reshard reads (`MergedShard`, exported to an HF folder) against the same; the folder
`write_peft_folder` writes, loaded by PEFT (same log-probs) and by a fresh engine (same adapters
back, through `adapters_from_hf`); the exported names against PEFT's own for that model. On the MoE
model also: an explicit linear_fc1 target refused by the engine. Results go to OUT.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
MODELS = {"qwen3-moe": REPO / "models" / "tiny-qwen3-moe", "qwen3": REPO / "models" / "tiny-qwen3"}
RANK, ALPHA = 4, 8.0
# token sequences of several lengths (vocab 512; the log-probs need no tokenizer)
LENGTHS = (17, 40, 29)


def sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g) for n in LENGTHS]


def hf_logprobs(model: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence [len-1]: entry t is log p(seq[t+1] | seq[:t+1]) (the engine's alignment)."""
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(s[None]).logits[0].float(), -1)
            out.append(lp[:-1].gather(-1, s[1:, None])[:, 0])
    return out


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def peft_names(path: Path, hf_targets: list[str]) -> list[str]:
    """The adapter tensor names PEFT itself saves for this model and these target modules."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    pm = get_peft_model(load_hf(path), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=hf_targets))
    return sorted(get_peft_model_state_dict(pm))


def model_checks(name: str, path: Path, tmp: Path) -> dict[str, Any]:
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import save_file

    from hpcrl.engines.megatron.engine import EngineOptions, MegatronEngine
    from hpcrl.engines.megatron.lora import LoraSettings, adapters_to_hf, resolve_targets, write_peft_folder

    t0 = time.time()
    res: dict[str, Any] = {}
    settings = LoraSettings(RANK, ALPHA, targets=resolve_targets(["all-linear"]), seed=11)
    e = MegatronEngine(str(path), EngineOptions(lora=settings))
    assert e.lora is not None
    res["adapted"] = sorted(e.lora.layers)
    res["targets"] = list(e.lora.settings.targets)
    res["trainable"] = sorted(n for n, p in e.model.named_parameters() if p.requires_grad)
    res["lora_params_anywhere"] = sorted(n for n, _ in e.model.named_parameters() if ".lora_" in n)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in e.lora.adapter_params().items():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    seqs = sequences()
    lp_on = e.compute_logprob(seqs)
    with e.lora.adapters_off():
        lp_off = e.compute_logprob(seqs)

    # the adapters PEFT-named, on the HF model through peft
    hf_adapters = adapters_to_hf(e.arch, [e.adapter_shard()], 0, 1)
    res["exported_names"] = sorted(hf_adapters)
    hf_targets = sorted({k.split(".")[-3] for k in hf_adapters})
    res["hf_targets"] = hf_targets
    res["peft_names"] = peft_names(path, hf_targets)
    base = load_hf(path)
    lp_hf = hf_logprobs(base, seqs)
    pm = get_peft_model(load_hf(path), LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                   target_modules=hf_targets)).eval()
    load = set_peft_model_state_dict(pm, {k: v.clone() for k, v in hf_adapters.items()})
    res["peft_unexpected"] = sorted(load.unexpected_keys)
    lp_peft = hf_logprobs(pm, seqs)
    res["base_vs_hf"] = max_diff(lp_off, lp_hf)
    res["adapters_move"] = max_diff(lp_on, lp_off)
    res["engine_vs_peft"] = max_diff(lp_on, lp_peft)

    # the merged weights the reshard reads, as an HF folder
    merged = e.export_hf_stage()
    assert merged is not None
    folder = tmp / f"{name}-merged"
    folder.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    save_file({k: v.contiguous() for k, v in merged.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    res["merged_vs_peft"] = max_diff(hf_logprobs(load_hf(folder), seqs), lp_peft)

    # the PEFT folder hpcrl writes: in peft, and back into a fresh engine
    out = tmp / f"{name}-peft"
    write_peft_folder(out, hf_adapters, settings, str(path))
    res["adapter_config_targets"] = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    folder_pm = PeftModel.from_pretrained(load_hf(path), str(out)).eval()
    res["folder_vs_peft"] = max_diff(hf_logprobs(folder_pm, seqs), lp_peft)
    e2 = MegatronEngine(str(path), EngineOptions(lora=settings, lora_adapters=str(out)))
    a1, a2 = e.adapter_shard(), e2.adapter_shard()
    res["reloaded_same_names"] = sorted(a1) == sorted(a2)
    res["reloaded_max_diff"] = max(float((a1[k] - a2[k]).abs().max()) for k in a1)
    res["reloaded_vs_engine"] = max_diff(e2.compute_logprob(seqs), lp_on)

    if name == "qwen3-moe":
        # linear_fc1 named explicitly: the engine refuses it, naming the key (the config path refuses it
        # earlier: resolve_targets(..., moe=True) in the preflight, tested in the pytest process)
        try:
            MegatronEngine(str(path), EngineOptions(lora=LoraSettings(
                RANK, ALPHA, targets=resolve_targets(["linear_qkv", "linear_fc1"]))))
            res["explicit_fc1_error"] = None
        except ValueError as err:
            res["explicit_fc1_error"] = str(err)
        # a PEFT folder adapting MLP modules is refused on the MoE model, not half-loaded
        mlp = {**hf_adapters, "base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.zeros(RANK, 128),
               "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.zeros(8, RANK)}
        bad = tmp / f"{name}-peft-mlp"
        write_peft_folder(bad, mlp, settings, str(path))
        try:
            MegatronEngine(str(path), EngineOptions(lora=settings, lora_adapters=str(bad)))
            res["mlp_folder_error"] = None
        except ValueError as err:
            res["mlp_folder_error"] = str(err)
    res["seconds"] = round(time.time() - t0, 2)
    return res


def main() -> None:
    torch.manual_seed(0)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from hpcrl.engines.megatron.engine import init_model_parallel

    init_model_parallel(1, 1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in MODELS.items():
            results[name] = model_checks(name, path, Path(tmp))
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
