"""LoRA on the FSDP engine through PEFT (`actor.lora` with `actor.engine=fsdp`).

Map:
- `apply_peft_lora`: PEFT's LoRA layers put into the HF model in place (`peft.inject_adapter_in_model`)
  before `fully_shard` cuts it: a targeted linear layer keeps its weight as `<module>.base_layer.weight`
  and gains `lora_A.default` [r, in] and `lora_B.default` [out, r] (zero), its output
  W x + (alpha / r) B A dropout(x); every other weight is frozen. The targets are `actor.lora.
  target_modules` as the Megatron engine reads them (`resolve_targets`: megatron names, HF names,
  all-linear; on an MoE model the attention alone, `model_targets`), found among each decoder layer's own
  attention / MLP linear layers under their HF names, fused ones included (Phi-3's qkv_proj and
  gate_up_proj). lora_A is drawn from a generator seeded by trainer.seed, alike on every rank (each
  rank's full copy is what fully_shard cuts), without touching the global RNG streams. A PEFT folder
  (`actor.lora.adapters`) replaces the drawn adapters by name.
- `FsdpLora.adapters_off`: the frozen base alone (the reference policy of a LoRA run: no second copy).
- Names: a base weight's HF name drops `.base_layer` (`hf_base_name`); an adapter's PEFT name (the
  file `PeftModel.from_pretrained` reads) is `base_model.model.<module>.lora_A.weight` (`peft_name`).
- `merged`: W + scale B A of full tensors, in fp32 (the reshard into vLLM, `hpcrl ckpt export-hf`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from hpcrl.engines.megatron.lora import HF_PARTS, PEFT_PREFIX, LoraSettings, model_targets, read_peft_folder

# fused HF layers that hold a megatron layer's parts in one (Phi-3)
FUSED = {"linear_qkv": ("qkv_proj",), "linear_fc1": ("gate_up_proj",)}
ADAPTER_TAGS = (".lora_A.", ".lora_B.")


def hf_base_name(name: str) -> str:
    """The HF name of a (possibly adapted) base parameter."""
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return any(t in name for t in ADAPTER_TAGS)


def peft_name(name: str) -> str:
    """`<module>.lora_A.default.weight` -> the name in a PEFT adapter file."""
    return PEFT_PREFIX + name.replace(".default.", ".")


def target_modules(hf: torch.nn.Module, settings: LoraSettings, is_moe: bool) -> list[str]:
    """Full module paths of the linear layers `settings.targets` adapt: a decoder layer's direct
    attention (`self_attn.<x>`) or MLP (`mlp.<x>`) linear layers, by their HF names. ValueError naming
    actor.lora.target_modules when a target matches none."""
    targets = model_targets(settings.targets, SimpleNamespace(is_moe=is_moe))
    found: dict[str, list[str]] = {t: [] for t in targets}
    for path, module in hf.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = path.split(".")
        # <...>.layers.<i>.<self_attn|mlp>.<leaf>: the layer's own linear layers, never an expert's
        if len(parts) < 4 or not parts[-3].isdigit():
            continue
        block, leaf = parts[-2], parts[-1]
        for t in targets:
            hf_block, hf_parts = HF_PARTS[t]
            if block == hf_block and leaf in hf_parts + FUSED.get(t, ()):
                found[t].append(path)
    missing = [t for t, paths in found.items() if not paths]
    if missing:
        raise ValueError(f"actor.lora.target_modules: {missing} match no linear layer of {type(hf).__name__} (its "
                         f"decoder layers' attention and MLP linear layers are looked up by the HF names "
                         f"{[p for t in missing for p in HF_PARTS[t][1] + FUSED.get(t, ())]})")
    return sorted(p for paths in found.values() for p in paths)


@dataclass
class FsdpLora:
    """The adapters of one FSDP actor (PEFT's LoRA layers, `modules` by path)."""

    settings: LoraSettings
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    active: bool = True  # false inside adapters_off

    @property
    def scale(self) -> float:
        return self.settings.scale

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The base model alone. PEFT's own switch (`enable_adapters`) also flips the adapters'
        requires_grad; this sets only the flag its forward reads."""
        for m in self.modules.values():
            m._disable_adapters = True
        self.active = False
        try:
            yield
        finally:
            for m in self.modules.values():
                m._disable_adapters = False
            self.active = True


def apply_peft_lora(hf: torch.nn.Module, settings: LoraSettings, is_moe: bool, adapters: str | None = None
                    ) -> FsdpLora:
    """PEFT's LoRA layers in `hf` (in place; see the module docstring); adapters: a PEFT folder to start from."""
    from peft import LoraConfig, inject_adapter_in_model

    paths = target_modules(hf, settings, is_moe)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=paths, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        inject_adapter_in_model(config, hf)
    modules = dict(hf.named_modules())
    lora = FsdpLora(settings, {p: modules[p] for p in paths})
    if adapters is not None:
        load_peft_adapters(hf, adapters, settings)
    return lora


def load_peft_adapters(hf: torch.nn.Module, folder: str, settings: LoraSettings) -> None:
    """Copy a PEFT folder's adapters into the injected ones, by name; ValueError naming actor.lora.adapters
    on a rank or a shape that differs."""
    cfg, get = read_peft_folder(folder)
    if int(cfg.get("r", settings.rank)) != settings.rank:
        raise ValueError(f"actor.lora.adapters={folder}: r={cfg.get('r')} there, actor.lora.rank={settings.rank} here")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not is_adapter(name):
                continue
            try:
                t = get(peft_name(name))
            except KeyError as e:
                raise ValueError(f"actor.lora.adapters={folder}: {e.args[0]}") from None
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"actor.lora.adapters={folder}: {peft_name(name)} is {tuple(t.shape)}, this model's "
                                 f"adapter is {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def adapter_pairs(names: list[str]) -> dict[str, tuple[str, str]]:
    """HF name of each adapted weight -> the parameter names of its (lora_A, lora_B)."""
    out = {}
    for n in names:
        if ".lora_A." in n:
            module = n.split(".lora_A.")[0]
            out[f"{module}.weight"] = (n, n.replace(".lora_A.", ".lora_B."))
    return out


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale B A, computed in fp32, in W's dtype."""
    return (base.float() + scale * (b.float() @ a.float())).to(base.dtype)


def merged_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full HF-named weights of a PEFT-injected model's state (`<module>.base_layer.weight` and its
    adapters): every adapted weight merged, the adapters themselves left out."""
    pairs = adapter_pairs(list(state))
    out = {}
    for name, t in state.items():
        if is_adapter(name):
            continue
        hf = hf_base_name(name)
        out[hf] = merged(t, state[pairs[hf][0]], state[pairs[hf][1]], scale) if hf in pairs else t
    return out
