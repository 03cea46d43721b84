"""LoRA adapters on the Megatron engine's linear layers (actor.lora, docs/algorithms.md).

Map:
- `LoraSettings`: rank, alpha, dropout and the targeted layers (megatron's names; HF aliases
  accepted by `resolve_targets`).
- `apply_lora`: freezes the model and gives each targeted layer this rank's part of an adapter,
  `lora_A` [r, in] and `lora_B` [out, r], as parameters of that layer (so the base weights keep
  their names), added to its output by a forward hook: y = W x + (alpha / r) B A dropout(x).
- TP split, matching the base layer (each rank computes only its share; one all-reduce of an
  r-wide activation per layer where the split needs it):
    column-parallel (linear_qkv, linear_fc1; W split by output rows): A replicated, B split by
    rows like W. A's output is copied into the TP region (backward: all-reduce), so every rank's
    copy of A gets the whole gradient, as a norm weight does.
    row-parallel (linear_proj, linear_fc2; W split by input columns): A split by columns like W,
    B replicated. A's partial outputs are summed over TP before B.
- `MergedShard`: this rank's base shard with W + scale B A in place of W for adapted layers,
  computed per tensor on access (resharding into vLLM reads it bucket by bucket, so no rank
  holds a merged model and an un-merged one at once). Merging is local: the split above makes
  B A of a rank's parts exactly that rank's part of the full B A.
- `adapters_off`: the frozen base alone (the reference policy of a LoRA run: no second copy).
- `adapters_to_hf` / `adapters_from_hf`: megatron shards <-> PEFT-named full tensors; megatron
  fuses q/k/v and gate/up, so their PEFT adapters share one lora_A (`write_peft_folder` writes
  them that way; a PEFT folder whose q/k/v A's differ is refused).
- Mixture-of-experts models (Qwen3-MoE): adapters on the attention only. Every layer's MLP there
  is a router plus experts (`mlp.router`, `mlp.experts.local_experts.<i>.linear_fc1|2`), which
  PEFT's per-layer names cannot hold; all-linear means linear_qkv and linear_proj, an MLP target
  named explicitly is refused (`resolve_targets(..., moe=True)`, `model_targets`), and only
  `decoder.layers.<i>.self_attention|mlp.<layer>` itself is ever adapted (never an expert, never the
  router). Qwen3's q/k norms (`self_attention.q_layernorm|k_layernorm`) are norms: never targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcrl.engines.megatron.convert import _qkv_shard, _split_qkv, layer_range
from hpcrl.engines.megatron.model import ModelArch

COLUMN = ("linear_qkv", "linear_fc1")
ROW = ("linear_proj", "linear_fc2")
TARGETS = COLUMN + ROW
ATTENTION = ("linear_qkv", "linear_proj")
MLP = ("linear_fc1", "linear_fc2")
# HF module names -> the megatron layer holding them; fused layers need all their parts
HF_ALIASES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
HF_PARTS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "linear_proj": ("self_attn", ("o_proj",)),
            "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
# the only modules adapted: a transformer layer's own attention / dense-MLP linear layers (so never
# an MoE layer's experts, `mlp.experts.local_experts.<i>.linear_fc1`, nor its router)
_ADAPTABLE = re.compile(r"decoder\.layers\.\d+\.(?:self_attention\.(?:linear_qkv|linear_proj)"
                        r"|mlp\.(?:linear_fc1|linear_fc2))")
_MOE_REFUSAL = ("{listed}: this is a mixture-of-experts model; its MLPs are a router and experts, and LoRA on "
                "experts is not supported (attention only). Use all-linear (on an MoE model: the attention "
                "layers) or linear_qkv / linear_proj (HF: q_proj, k_proj, v_proj, o_proj)")


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS  # megatron layer names
    seed: int = 0  # lora_A's initialisation (the same for every layout)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Targets(tuple):
    """`resolve_targets`' megatron layer names (a tuple), remembering whether all-linear alone put the
    MLP layers there (`all_linear`): an MoE model then takes the attention layers only, while MLP
    layers named explicitly are refused there (see `model_targets`)."""

    all_linear: bool

    def __new__(cls, names: Any = (), all_linear: bool = False) -> Targets:
        self = super().__new__(cls, names)
        self.all_linear = all_linear
        return self

    def __reduce__(self) -> Any:
        return (Targets, (tuple(self), self.all_linear))


def resolve_targets(names: list[str] | tuple[str, ...], moe: bool = False) -> Targets:
    """Megatron layer names from a target list of megatron or HF names (or all-linear).
    ValueError names an unknown entry, or a fused layer listed by only some of its HF parts; with
    moe (the model is a mixture of experts): an MLP layer named explicitly, and all-linear gives
    the attention layers alone."""
    out: list[str] = []
    hf_seen: set[str] = set()
    explicit_mlp: list[str] = []
    for n in names:
        if n == "all-linear":
            out.extend(ATTENTION if moe else TARGETS)
        elif n in TARGETS:
            out.append(n)
            explicit_mlp += [n] if n in MLP else []
        elif n in HF_ALIASES:
            hf_seen.add(n)
            out.append(HF_ALIASES[n])
            explicit_mlp += [n] if HF_ALIASES[n] in MLP else []
        else:
            raise ValueError(f"actor.lora.target_modules: unknown module {n!r}; use megatron names {list(TARGETS)}, "
                             f"HF names {sorted(HF_ALIASES)}, or all-linear")
    for layer, (_, parts) in HF_PARTS.items():
        listed = hf_seen & set(parts)
        if listed and listed != set(parts):
            raise ValueError(f"actor.lora.target_modules: {sorted(listed)} without {sorted(set(parts) - listed)}: "
                             f"megatron fuses {', '.join(parts)} into one layer ({layer}), which takes one adapter; "
                             f"list all of them, or {layer}")
    if not out:
        raise ValueError("actor.lora.target_modules is empty")
    if moe and explicit_mlp:
        raise ValueError("actor.lora.target_modules: " + _MOE_REFUSAL.format(listed=f"{explicit_mlp} are MLP layers"))
    return Targets((t for t in TARGETS if t in out), all_linear=not explicit_mlp)


def model_targets(targets: tuple[str, ...], arch: ModelArch) -> tuple[str, ...]:
    """The layers `targets` adapt on the model of `arch`: all of them on a dense model; on an MoE
    model the attention layers, with the MLP ones dropped when they came from all-linear (a `Targets`
    that says so, or the full default `TARGETS`) and refused (ValueError) when named explicitly."""
    mlp = [t for t in targets if t in MLP]
    if not arch.is_moe or not mlp:
        return tuple(targets)
    all_linear = getattr(targets, "all_linear", tuple(targets) == TARGETS)
    if not all_linear:
        raise ValueError("actor.lora.target_modules: " + _MOE_REFUSAL.format(listed=f"{mlp} are MLP layers"))
    return tuple(t for t in targets if t in ATTENTION)


def _layer_kind(name: str) -> str | None:
    """linear_qkv | linear_proj | linear_fc1 | linear_fc2 for a transformer layer's own linear layer
    (`decoder.layers.<i>.self_attention|mlp.<kind>`), None for anything else (experts, router, norms)."""
    return name.rsplit(".", 1)[-1] if _ADAPTABLE.fullmatch(name) else None


def _init_a(settings: LoraSettings, global_layer: int, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    """The full lora_A of one layer, uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5))),
    from a generator keyed by (seed, layer, kind): every layout draws the same adapter."""
    key = hashlib.blake2b(f"{settings.seed}/{global_layer}/{kind}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little") % (1 << 62))
    bound = 1.0 / shape[1] ** 0.5
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoraState:
    """The adapters of one engine's model: what `apply_lora` made, and switches over them."""

    def __init__(self, settings: LoraSettings, layers: dict[str, torch.nn.Module], tp_rank: int, tp_size: int):
        self.settings = settings
        self.layers = layers  # megatron module name -> adapted layer
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.enabled = True
        # dropout: a seed shared by the TP ranks, drawn per optimizer step (see begin_step)
        self.dropout_seed: int | None = None

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The frozen base model alone, inside the block."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def begin_step(self) -> None:
        """With dropout: draw this step's dropout seed from the rank's torch generator (checkpointed
        with the other RNG states) and take TP rank 0's, so the TP ranks drop the same inputs of a
        replicated lora_A. Every layer then draws from a generator keyed by (seed, layer, call)."""
        if not self.settings.dropout:
            return
        seed = torch.randint(0, 1 << 62, (1,), dtype=torch.int64)
        if self.tp_size > 1:
            from megatron.core import parallel_state as ps

            torch.distributed.broadcast(seed, src=ps.get_tensor_model_parallel_src_rank(),
                                        group=ps.get_tensor_model_parallel_group())
        self.dropout_seed = int(seed)
        for m in self.layers.values():
            m.lora_calls = 0

    def adapter_params(self) -> dict[str, torch.nn.Parameter]:
        return {f"{n}.lora_{ab}": getattr(m, f"lora_{ab}") for n, m in self.layers.items() for ab in "AB"}

    def merged(self, name: str, module: torch.nn.Module) -> torch.Tensor:
        """W + scale B A of this rank's shard of a layer (in W's dtype, computed in fp32)."""
        w = module.weight.detach()
        delta = module.lora_B.detach().float() @ module.lora_A.detach().float()
        return (w.float() + self.settings.scale * delta).to(w.dtype)


def apply_lora(model: torch.nn.Module, settings: LoraSettings, arch: ModelArch, pp_rank: int, pp_size: int,
               tp_rank: int, tp_size: int) -> LoraState:
    """Freeze `model` and adapt its targeted layers in place (see the module docstring). On an MoE
    model the targets are `model_targets`' (attention only); the returned state's settings hold the
    layers actually adapted. ValueError when a targeted layer is missing from a transformer layer."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    settings = dataclasses.replace(settings, targets=model_targets(settings.targets, arch))
    for p in model.parameters():
        p.requires_grad_(False)
    first = layer_range(arch, pp_rank, pp_size).start
    layers: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        kind = _layer_kind(name)
        if kind is None or kind not in settings.targets:
            continue
        local = int(name.split(".")[2])  # decoder.layers.{local}.<block>.<kind>
        w = module.weight
        column = kind in COLUMN
        full_in = w.shape[1] * (1 if column else tp_size)
        a_full = _init_a(settings, first + local, kind, (settings.rank, full_in))
        a = a_full if column else a_full.chunk(tp_size, dim=1)[tp_rank]
        module.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        module.lora_B = torch.nn.Parameter(torch.zeros(w.shape[0], settings.rank, device=w.device, dtype=w.dtype))
        sharded, dim = (module.lora_B, 0) if column else (module.lora_A, 1)
        sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = True, dim, 1
        module.lora_kind = kind
        module.lora_calls = 0
        layers[name] = module
    local_layers = len(layer_range(arch, pp_rank, pp_size))
    found = {(int(n.split(".")[2]), n.rsplit(".", 1)[-1]) for n in layers}
    missing = [(i, k) for i in range(local_layers) for k in settings.targets if (i, k) not in found]
    if missing:
        raise ValueError(f"LoRA: the model has no {missing[0][1]} in transformer layer {first + missing[0][0]} "
                         f"(decoder.layers.{missing[0][0]}.{_block(missing[0][1])}.{missing[0][1]}); "
                         f"actor.lora.target_modules resolves to {list(settings.targets)}")
    state = LoraState(settings, layers, tp_rank, tp_size)
    layer_ids = {name: i for i, name in enumerate(layers)}

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not state.enabled:
            return output
        x = args[0]
        if settings.dropout and module.training:
            x = _dropout(x, settings.dropout, state, layer_ids[module.lora_name], module)
        if module.lora_kind in COLUMN:
            a = copy_to_tensor_model_parallel_region(torch.nn.functional.linear(x, module.lora_A))
        else:
            a = reduce_from_tensor_model_parallel_region(torch.nn.functional.linear(x, module.lora_A))
        delta = torch.nn.functional.linear(a, module.lora_B) * settings.scale
        if isinstance(output, tuple):
            return (output[0] + delta.to(output[0].dtype), *output[1:])
        return output + delta.to(output.dtype)

    for name, module in layers.items():
        module.lora_name = name
        module.register_forward_hook(hook)
    return state


def _dropout(x: torch.Tensor, p: float, state: LoraState, layer_id: int, module: torch.nn.Module) -> torch.Tensor:
    """Inverted dropout with a mask from (step seed, layer, call): the same on TP ranks that hold
    the same input (column-parallel: replicated), a rank's own otherwise (row-parallel: split)."""
    seed = state.dropout_seed if state.dropout_seed is not None else 0
    own = state.tp_rank if module.lora_kind in ROW else 0
    key = hashlib.blake2b(f"{seed}/{layer_id}/{module.lora_calls}/{own}".encode(), digest_size=8).digest()
    module.lora_calls += 1
    g = torch.Generator(device=x.device).manual_seed(int.from_bytes(key, "little") % (1 << 62))
    keep = torch.rand(x.shape, generator=g, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


class MergedShard(Mapping[str, torch.Tensor]):
    """This rank's Megatron shard as the base state dict names it, adapted layers merged on access
    (the base weights inside `adapters_off`)."""

    def __init__(self, model: torch.nn.Module, state: LoraState):
        self._base = {k: v for k, v in model.state_dict(keep_vars=True).items()
                      if not k.endswith("_extra_state") and ".lora_" not in k}
        self._merge = {f"{n}.weight": (n, m) for n, m in state.layers.items()}
        self._state = state

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._merge and self._state.enabled:
            return self._state.merged(*self._merge[key])
        return self._base[key].detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


# PEFT names <-> megatron shards ---------------------------------------------------------------
def _peft_name(layer: int, block: str, part: str, ab: str) -> str:
    return f"{PEFT_PREFIX}model.layers.{layer}.{block}.{part}.lora_{ab}.weight"


def _block(kind: str) -> str:
    return "self_attention" if kind in ("linear_qkv", "linear_proj") else "mlp"


def adapters_to_hf(arch: ModelArch, tp_shards: list[dict[str, torch.Tensor]], pp_rank: int,
                   pp_size: int) -> dict[str, torch.Tensor]:
    """PEFT-named full adapters of one pipeline stage from its TP ranks' adapter tensors (megatron
    names `decoder.layers.{local}.<block>.<layer>.lora_A|B`, TP order). Fused layers give each
    HF part the shared lora_A and its rows of lora_B."""
    out: dict[str, torch.Tensor] = {}
    first = layer_range(arch, pp_rank, pp_size).start
    s0 = tp_shards[0]
    for key in sorted(k for k in s0 if k.endswith(".lora_A")):
        base = key[:-len(".lora_A")]
        kind = _layer_kind(base)
        if kind is None or (arch.is_moe and kind in MLP):
            # PEFT's names hold one adapter per layer and module: an expert's would overwrite another's
            raise ValueError(f"{key}: no PEFT name for an adapter there (hpcrl adapts a layer's own "
                             "linear_qkv / linear_proj / linear_fc1 / linear_fc2; on an MoE model the attention only)")
        local = int(base.split(".")[2])
        block, parts = HF_PARTS[kind]
        layer = first + local
        a_parts = [s[f"{base}.lora_A"] for s in tp_shards]
        b_parts = [s[f"{base}.lora_B"] for s in tp_shards]
        if kind in COLUMN:
            a = a_parts[0]
            if kind == "linear_qkv":
                bs = _split_qkv(arch, b_parts)
            else:
                gates, ups = zip(*(b.chunk(2, dim=0) for b in b_parts), strict=True)
                bs = (torch.cat(gates), torch.cat(ups))
        else:
            a, bs = torch.cat(a_parts, dim=1), (b_parts[0],)
        for part, b in zip(parts, bs, strict=True):
            out[_peft_name(layer, block, part, "A")] = a.clone()
            out[_peft_name(layer, block, part, "B")] = b.contiguous().clone()
    return out


def adapters_from_hf(arch: ModelArch, get: Callable[[str], torch.Tensor], targets: tuple[str, ...], tp_rank: int,
                     tp_size: int, pp_rank: int, pp_size: int) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors (megatron names) from PEFT-named full tensors. ValueError when
    the parts of a fused layer have different lora_A (megatron's fused layer takes one), and on an
    MoE model when MLP layers are targeted or (a `read_peft_folder` getter) the folder adapts any
    module of an MLP (its experts or router: hpcrl would drop those adapters)."""
    if arch.is_moe:
        mlp = [t for t in targets if t in MLP]
        if mlp:
            raise ValueError("actor.lora.target_modules: " + _MOE_REFUSAL.format(listed=f"{mlp} are MLP layers"))
        foreign = sorted(n for n in getattr(get, "names", ()) if ".lora_" in n and ".self_attn." not in n)
        if foreign:
            raise ValueError(f"{getattr(get, 'path', 'the PEFT folder')}: adapters outside the attention "
                             f"({foreign[0]}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); "
                             "on a mixture-of-experts model hpcrl adapts the attention only "
                             "(LoRA on experts is not supported)")
    out: dict[str, torch.Tensor] = {}
    for local, layer in enumerate(layer_range(arch, pp_rank, pp_size)):
        for kind in targets:
            block, parts = HF_PARTS[kind]
            hf_block = block
            a_all = [get(_peft_name(layer, hf_block, p, "A")) for p in parts]
            b_all = [get(_peft_name(layer, hf_block, p, "B")) for p in parts]
            for p, a in zip(parts[1:], a_all[1:], strict=True):
                if not torch.equal(a, a_all[0]):
                    raise ValueError(f"layer {layer}: {parts[0]} and {p} have different lora_A; megatron fuses "
                                     f"{', '.join(parts)} into {kind}, which takes one adapter (one shared lora_A)")
            m = f"decoder.layers.{local}.{_block(kind)}.{kind}"
            if kind == "linear_qkv":
                a, b = a_all[0], _qkv_shard(arch, *b_all, tp_rank, tp_size)
            elif kind == "linear_fc1":
                a = a_all[0]
                b = torch.cat([bb.chunk(tp_size, dim=0)[tp_rank] for bb in b_all])
            else:
                a, b = a_all[0].chunk(tp_size, dim=1)[tp_rank], b_all[0]
            out[f"{m}.lora_A"], out[f"{m}.lora_B"] = a.contiguous(), b.contiguous()
    return out


_PEFT_PART = re.compile(re.escape(PEFT_PREFIX) + r"model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.lora_[AB]\.weight")


def peft_config(settings: LoraSettings, base_model: str, hf_targets: list[str] | None = None) -> dict[str, Any]:
    """adapter_config.json of a PEFT LoRA folder holding these adapters (target_modules: hf_targets,
    or the HF parts of settings.targets)."""
    if hf_targets is None:
        hf_targets = sorted(p for t in settings.targets for p in HF_PARTS[t][1])
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": hf_targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def write_peft_folder(out: str | Path, tensors: dict[str, torch.Tensor], settings: LoraSettings,
                      base_model: str) -> None:
    """adapter_model.safetensors + adapter_config.json, as `PeftModel.from_pretrained` reads them.
    target_modules lists the modules `tensors` adapt (on an MoE model: the attention's), so PEFT
    puts no fresh adapter on a module these tensors leave out."""
    from safetensors.torch import save_file

    out = Path(out)
    parts = sorted({m.group(1) for k in tensors if (m := _PEFT_PART.fullmatch(k))})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(settings, base_model, parts or None), indent=1))


def read_peft_folder(path: str | Path) -> tuple[dict[str, Any], Callable[[str], torch.Tensor]]:
    """(adapter_config, getter of PEFT-named tensors) of a PEFT LoRA folder."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / ADAPTER_FILE
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{path}: not a PEFT adapter folder (needs adapter_config.json and {ADAPTER_FILE})")
    cfg = json.loads(cfg_file.read_text())
    handle = safe_open(str(weights), framework="pt")
    names = set(handle.keys())

    def get(name: str) -> torch.Tensor:
        # PEFT writes names without the adapter's name; some tools keep ".default"
        for n in (name, name.replace(".lora_A.weight", ".lora_A.default.weight")
                  .replace(".lora_B.weight", ".lora_B.default.weight")):
            if n in names:
                return handle.get_tensor(n)
        raise KeyError(f"{weights}: no tensor {name!r} (is every target module of this run adapted there?)")

    get.names = frozenset(names)  # type: ignore[attr-defined]  (adapters_from_hf checks them on MoE models)
    get.path = str(path)  # type: ignore[attr-defined]
    return cfg, get
