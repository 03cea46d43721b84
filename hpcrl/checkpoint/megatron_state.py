"""Worker side of a checkpoint: one rank's Megatron shard with its optimizer state, and RNG states.

Files, relative to the checkpoint folder (see docs/checkpoint.md)::

    {role}/pp{P}_tp{T}.safetensors   written by the rank (TP T, stage P) of DP replica 0 only:
        param::<megatron name>       the weights, in the model's dtype
        master::<name>               fp32 master copy (bf16 models)
        exp_avg::<name>, exp_avg_sq::<name>, step::<name>   torch AdamW's per-parameter state
    {role}/pp{P}_tp{T}.json          the rest: layout, arch, spec, dtype, step_count, param names,
                                     optimizer param_groups, which optimizer keys are per-element
    rng/rank{R}.pt                   RNG states of torch.distributed rank R (every rank; hpcrl.checkpoint.rng)

Why every rank writes its own shard: nobody ever gathers a whole model (the save scales with the
number of writers), and a load into the same layout reads back exactly the bytes it wrote, so a
resumed run is bit-exact. A load into another layout (TP/PP, spec, dtype) rebuilds each tensor the
way the HF weights were loaded in the first place: the saved TP shards of one unit (embedding, one
layer, final norm + head) are joined into HF-named full tensors (`megatron_to_hf_partial`) and cut
for the new layout (`hf_to_megatron`). Optimizer moments have their parameter's shape, so they
travel the same way. Only one unit is held at full size at a time.

With the optimizer state sharded over DP (`actor.optim.shard_over_dp`, hpcrl.engines.megatron.
optim_shards), the writer (DP replica 0) receives the other replicas' moments and masters at save
time: the file holds the whole state, as without sharding, and loads either way; a load keeps each
rank's own share.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hpcrl.checkpoint.files import FileRecord, file_record, fsync_dir, fsync_file, is_no_space, write_durable
from hpcrl.checkpoint.rng import capture_rng, restore_or_reseed, rng_blob, write_rng
from hpcrl.checkpoint.store import DiskFullError, no_space_error
from hpcrl.engines.megatron.convert import expert_of, global_name, hf_to_megatron, layer_range, megatron_to_hf_partial
from hpcrl.engines.megatron.model import ModelArch

log = logging.getLogger("hpcrl.checkpoint")

SHARD_FORMAT = "hpcrl-megatron-shard/1"
SEP = "::"
PARAM, MASTER = "param", "master"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Checkpoint folders whose RNG file this process already wrote: colocated roles (actor, critic,
# reference) share one process and so one RNG state; the first role saved writes it.
_rng_written: set[str] = set()
# Size estimates (checkpoint_nbytes): a file takes whole blocks (4 KiB on ext4, xfs, tmpfs), and
# a safetensors header holds per tensor its name, dtype, shape and offsets as JSON.
FILE_SLACK = 4096
HEADER_PER_TENSOR = 128


def shard_stem(pp_rank: int, tp_rank: int, ep_rank: int | None = None) -> str:
    """A shard's file name; with expert parallel each EP rank writes its own (its experts under their
    global index, and a copy of the rest of the stage)."""
    return f"pp{pp_rank}_tp{tp_rank}" + (f"_ep{ep_rank}" if ep_rank is not None else "")


def _engine_stem(engine: Any) -> str:
    ep = getattr(engine, "ep_size", 1)
    return shard_stem(engine.pp_rank, engine.tp_rank, engine.ep_rank if ep > 1 else None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class ShardState:
    """What one rank writes for one role: tensors keyed `kind::megatron name`, and JSON metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


# saving ----------------------------------------------------------------------------------------
def engine_state(engine: Any, role: str, model_path: str, copy: bool,
                 others: dict[int, dict[str, torch.Tensor]] | None = None) -> ShardState:
    """This rank's shard of `engine` (a MegatronEngine) with its optimizer state, on the CPU.

    copy=True takes private copies (async saves: the next step updates the live tensors in place
    while the writer thread still reads); copy=False aliases CPU tensors (a synchronous save).
    `others`: with the optimizer state sharded over DP, what the other DP ranks keep
    (`MegatronEngine.gather_optimizer_state`): the shard holds the whole state either way."""
    others = others or {}

    def cpu(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cpu":
            return t.to("cpu")
        return t.clone() if copy else t

    offset = getattr(engine, "experts_offset", 0)
    # experts under their global index: every EP rank's file holds other ones
    named = [(global_name(n, offset), p) for n, p in engine.named_trainable()]
    tensors = {f"{PARAM}{SEP}{n}": cpu(p) for n, p in named}
    if engine.master is not None:
        tensors.update({f"{MASTER}{SEP}{n}": cpu(m if m is not None else others[i][MASTER])
                        for i, ((n, _), m) in enumerate(zip(named, engine.master, strict=True))})
    optimizer: dict[str, Any] | None = None
    if engine.optimizer is not None:
        groups = engine.optimizer.param_groups
        if len(groups) != 1:
            raise ValueError(f"{len(groups)} optimizer param groups: checkpoints hold the single group "
                             "MegatronEngine builds (AdamW over all parameters)")
        per_element: set[str] = set()
        scalar: set[str] = set()
        other: dict[str, dict[str, Any]] = {}
        steps: set[float] = set()
        step_dtype = None
        for i, (n, p) in enumerate(named):
            q = engine.optimizer_param(i)
            state = engine.optimizer.state.get(q, {}) if q is not None else \
                {k: v for k, v in others.get(i, {}).items() if k != MASTER}
            for k, v in state.items():
                if k in (PARAM, MASTER) or SEP in k:
                    raise ValueError(f"optimizer state key {k!r} collides with the checkpoint's naming")
                if not torch.is_tensor(v):
                    other.setdefault(n, {})[k] = v
                    continue
                tensors[f"{k}{SEP}{n}"] = cpu(v)
                if v.shape == p.shape and v.dim() > 0:
                    per_element.add(k)
                else:
                    scalar.add(k)
                if k == "step":
                    steps.add(float(v))
                    step_dtype = _dtype_name(v.dtype)
        optimizer = {
            "class": type(engine.optimizer).__name__,
            "param_groups": [{k: v for k, v in groups[0].items() if k != "params"}],
            "per_element": sorted(per_element),
            "scalar": sorted(scalar),
            "other": other,
            # every parameter takes every step (missing gradients are zero-filled), so one value,
            # which a load into another layout gives to every new parameter
            "step": steps.pop() if len(steps) == 1 else None,
            "step_dtype": step_dtype,
        }
    meta = {
        "format": SHARD_FORMAT,
        "role": role,
        "layout": {"tp": engine.tp_size, "pp": engine.pp_size, "dp": engine.dp_size, "cp": engine.cp_size,
                   "ep": getattr(engine, "ep_size", 1), "ep_rank": getattr(engine, "ep_rank", 0),
                   "tp_rank": engine.tp_rank,
                   "pp_rank": engine.pp_rank},
        "spec": engine.spec,
        "dtype": _dtype_name(engine.options.dtype),
        "value_head": bool(engine.value_head),
        "arch": asdict(engine.arch),
        "model_path": str(Path(model_path).resolve()),
        "step_count": int(engine.step_count),
        # optimizer steps skipped in a row for a NaN/Inf gradient: trainer.max_nonfinite_steps counts
        # across a resume, so a run that fails every step cannot requeue itself forever
        "nonfinite_in_a_row": int(getattr(engine, "nonfinite_in_a_row", 0)),
        "params": [n for n, _ in named],
        "shapes": {n: list(p.shape) for n, p in named},
        "master": engine.master is not None,
        "optimizer": optimizer,
        "optim_settings": asdict(engine.optim) if engine.optim is not None else None,
        # LoRA: the tensors are the adapters alone; the frozen base is model_path's weights
        "lora": _lora_meta(engine),
    }
    return ShardState(tensors, meta)


def _lora_meta(engine: Any) -> dict[str, Any] | None:
    lora = getattr(engine, "lora", None)
    if lora is None:
        return None
    return {**asdict(lora.settings), "targets": list(lora.settings.targets)}


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def shard_nbytes(state: ShardState) -> int:
    """~Bytes one shard's two files take on disk (tensor data, header, metadata, block slack)."""
    return (_tensor_bytes(state.tensors.values()) + sum(len(k) + HEADER_PER_TENSOR for k in state.tensors)
            + len(json.dumps(state.meta, indent=1, sort_keys=True)) + 2 * FILE_SLACK)


def engine_nbytes(engine: Any) -> int:
    """~Bytes this rank's shard of `engine` will take (what engine_state + write_shard write), from
    the live tensors' sizes: nothing is copied, so it is cheap enough to ask before every save."""
    named = engine.named_trainable()
    weights = [p for _, p in named]
    state = 0
    tensors = len(weights) * (1 + (engine.master is not None))
    if engine.optimizer is not None:
        # this rank's optimizer state and masters, scaled to every parameter when other DP ranks
        # keep part of it (the shard holds the whole state)
        kept = engine.optimizer_state_bytes()
        owned = sum(p.numel() for i, p in enumerate(weights) if engine.steps_here(i))
        state = kept * sum(p.numel() for p in weights) // max(owned, 1)
        tensors += len(weights) * max((len(st) for st in engine.optimizer.state.values()), default=0)
    names = sum(len(n) for n, _ in named)
    # every tensor's header entry, and the metadata JSON (names and shapes of every parameter)
    return (_tensor_bytes(weights) + state + tensors * (HEADER_PER_TENSOR + 32) + 2 * names + 16384
            + 2 * FILE_SLACK)


def write_shard(state: ShardState, ckpt_dir: str | Path, role: str) -> list[FileRecord]:
    """Write and fsync one shard's two files; their records (size, sha256) for the manifest.

    Out of space (or quota): both files are removed and DiskFullError names the file and bytes
    (safetensors reports it as its own error type, not as an OSError)."""
    from safetensors.torch import save_file

    root = Path(ckpt_dir)
    d = root / role
    lay = state.meta["layout"]
    stem = shard_stem(lay["pp_rank"], lay["tp_rank"], lay["ep_rank"] if lay.get("ep", 1) > 1 else None)
    st, js = d / f"{stem}.safetensors", d / f"{stem}.json"
    meta = json.dumps(state.meta, indent=1, sort_keys=True)
    writing = st
    try:
        d.mkdir(parents=True, exist_ok=True)
        # one metadata key only: safetensors keeps them in a hash map, so several would be written
        # in a random order and two saves of the same state would differ in bytes
        save_file(state.tensors, str(st), metadata={"format": "pt"})
        fsync_file(st)
        writing = js
        write_durable(js, meta)
        fsync_dir(d)
    except Exception as e:
        if not is_no_space(e):
            raise
        for f in (st, js):  # a partial shard is worthless and holds space the others need
            f.unlink(missing_ok=True)
        raise no_space_error(writing, f"{role} shard of TP rank {lay['tp_rank']}, stage {lay['pp_rank']}",
                             shard_nbytes(state)) from e
    return [file_record(st, root), file_record(js, root)]


# reading a saved role --------------------------------------------------------------------------
def _unit_of(name: str) -> str:
    """Which conversion unit a Megatron parameter belongs to: embedding, layer.<i>, final."""
    if name.startswith("embedding."):
        return "embedding"
    m = _LAYER_RE.match(name)
    if m:
        return f"layer.{m.group(1)}"
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return "final"
    raise ValueError(f"{name}: a parameter the checkpoint converter does not know")


class SavedRole:
    """Lazy reader of one role's saved TP x PP shard files (safetensors are opened lazily and read
    tensor by tensor), able to hand out HF-named full tensors of any per-element kind."""

    def __init__(self, role_dir: str | Path) -> None:
        self.dir = Path(role_dir)
        first = self.dir / f"{shard_stem(0, 0)}.json"
        if not first.is_file() and (self.dir / f"{shard_stem(0, 0, 0)}.json").is_file():
            first = self.dir / f"{shard_stem(0, 0, 0)}.json"  # saved with expert parallel
        if not first.is_file():
            raise FileNotFoundError(f"{self.dir}: no {first.name}; is this a role folder of an hpcrl checkpoint?")
        self.meta0 = json.loads(first.read_text())
        if self.meta0.get("format") != SHARD_FORMAT:
            raise ValueError(f"{first}: not an {SHARD_FORMAT} shard")
        lay = self.meta0["layout"]
        self.tp, self.pp, self.ep = int(lay["tp"]), int(lay["pp"]), int(lay.get("ep", 1))
        self.arch = ModelArch(**self.meta0["arch"])
        self.per_ep = self.arch.num_experts // self.ep if self.ep > 1 else 0
        self.spec = self.meta0["spec"]
        self.value_head = bool(self.meta0["value_head"])
        self._metas: dict[tuple[int, int], dict[str, Any]] = {}
        self._handles: dict[tuple[int, int, int], Any] = {}
        self._cache: tuple[tuple[str, int, str], dict[str, torch.Tensor]] | None = None

    def _stem(self, pp: int, tp: int, ep: int) -> str:
        return shard_stem(pp, tp, ep if self.ep > 1 else None)

    def meta(self, pp: int, tp: int) -> dict[str, Any]:
        """A (stage, TP rank) shard's metadata; saved with EP, its EP ranks' files together (every
        parameter once: the experts of each, the rest from EP rank 0's)."""
        if (pp, tp) not in self._metas:
            metas = [json.loads((self.dir / f"{self._stem(pp, tp, e)}.json").read_text()) for e in range(self.ep)]
            merged = dict(metas[0])
            seen = set(merged["params"])
            for m in metas[1:]:
                extra = [n for n in m["params"] if n not in seen]
                merged["params"] = merged["params"] + extra
                merged["shapes"] = {**merged["shapes"], **{n: m["shapes"][n] for n in extra}}
                seen.update(extra)
            self._metas[(pp, tp)] = merged
        return self._metas[(pp, tp)]

    def tensor(self, pp: int, tp: int, key: str) -> torch.Tensor:
        from safetensors import safe_open

        expert = expert_of(key.split(SEP, 1)[-1])
        ep = expert // self.per_ep if expert is not None and self.per_ep else 0
        if (pp, tp, ep) not in self._handles:
            self._handles[(pp, tp, ep)] = safe_open(str(self.dir / f"{self._stem(pp, tp, ep)}.safetensors"),
                                                    framework="pt")
        return self._handles[(pp, tp, ep)].get_tensor(key)

    def kinds(self) -> list[str]:
        """The per-element tensor kinds saved for every parameter: param, master, exp_avg, ..."""
        out = [PARAM] + ([MASTER] if self.meta0["master"] else [])
        opt = self.meta0.get("optimizer")
        return out + (list(opt["per_element"]) if opt else [])

    def units(self, pp: int) -> list[str]:
        """The conversion units of stage `pp`, in model order."""
        seen: dict[str, None] = {}
        for n in self.meta(pp, 0)["params"]:
            seen.setdefault(_unit_of(n), None)
        order = {"embedding": -1, "final": 1 << 30}
        return sorted(seen, key=lambda u: order.get(u, int(u.split(".")[1]) if u.startswith("layer.") else 0))

    def unit_hf(self, kind: str, pp: int, unit: str) -> dict[str, torch.Tensor]:
        """HF-named full tensors of one unit of stage `pp` (the critic's value head left out)."""
        if self._cache is not None and self._cache[0] == (kind, pp, unit):
            return self._cache[1]
        names = [n for n in self.meta(pp, 0)["params"] if _unit_of(n) == unit
                 and not (self.value_head and n.startswith("output_layer."))]
        shards = [{n: self.tensor(pp, t, f"{kind}{SEP}{n}") for n in names} for t in range(self.tp)]
        for vocab_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if vocab_name in shards[0]:
                full_rows = sum(s[vocab_name].shape[0] for s in shards)
                if full_rows > self.arch.vocab_size:
                    pad = torch.cat([s[vocab_name] for s in shards])[self.arch.vocab_size:]
                    if pad.abs().max() > 0:
                        log.warning("%s %s: the vocab padding rows are not zero; a layout change drops them",
                                    kind, vocab_name)
        out = megatron_to_hf_partial(self.arch, shards, pp, self.pp, self.spec)
        self._cache = ((kind, pp, unit), out)
        return out

    def hf_getter(self, kind: str) -> Callable[[str], torch.Tensor]:
        """get(hf_name) -> the full tensor of that kind: what `hf_to_megatron` reads from."""
        per = self.arch.num_layers // self.pp

        def get(hf_name: str) -> torch.Tensor:
            if hf_name == "model.embed_tokens.weight":
                pp, unit = 0, "embedding"
            elif hf_name in ("model.norm.weight", "lm_head.weight"):
                pp, unit = self.pp - 1, "final"
            else:
                m = _HF_LAYER_RE.match(hf_name)
                if not m:
                    raise KeyError(f"{hf_name}: not a tensor of this model")
                layer = int(m.group(1))
                pp, unit = layer // per, f"layer.{layer - layer_range(self.arch, layer // per, self.pp).start}"
            return self.unit_hf(kind, pp, unit)[hf_name]

        return get

    def value_head_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """The critic's value head (replicated over TP: TP rank 0's copy of the last stage)."""
        last = self.pp - 1
        return {n: self.tensor(last, 0, f"{kind}{SEP}{n}") for n in self.meta(last, 0)["params"]
                if n.startswith("output_layer.")}


def _same_layout(engine: Any, meta: dict[str, Any] | None, names: list[str]) -> bool:
    if meta is None:
        return False
    lay = meta["layout"]
    return (lay["tp"] == engine.tp_size and lay["pp"] == engine.pp_size and lay.get("ep", 1) == engine.ep_size
            and meta["spec"] == engine.spec
            and meta["dtype"] == _dtype_name(engine.options.dtype) and meta["params"] == names
            and bool(meta["value_head"]) == bool(engine.value_head))


def converted_tensors(engine: Any, saved: SavedRole) -> dict[str, torch.Tensor]:
    """This rank's tensors (`kind::name`, as a shard file holds them) rebuilt from a save made in
    another layout, spec or dtype."""
    offset = engine.experts_offset
    names = [n for n, _ in engine.named_trainable()]
    kinds = saved.kinds()
    cur_dtype = engine.options.dtype
    saved_dtype = getattr(torch, saved.meta0["dtype"])
    # weights: the saved weights, or the fp32 masters when the dtype changes (more precise);
    # a new master copy: the saved master, or the saved (fp32) weights
    sources = {PARAM: MASTER if cur_dtype != saved_dtype and MASTER in kinds else PARAM}
    if engine.master is not None:
        sources[MASTER] = MASTER if MASTER in kinds else PARAM
    opt = saved.meta0.get("optimizer")
    if engine.optimizer is not None and opt:
        sources.update({k: k for k in opt["per_element"]})
    out: dict[str, torch.Tensor] = {}
    for kind, src in sources.items():
        shard = hf_to_megatron(saved.arch, saved.hf_getter(src), engine.tp_rank, engine.tp_size, engine.pp_rank,
                               engine.pp_size, engine.spec, lm_head=not engine.value_head, ep_rank=engine.ep_rank,
                               ep_size=engine.ep_size)
        if engine.value_head and engine.model.post_process:
            shard.update(saved.value_head_tensors(src))
        missing, extra = set(names) - shard.keys(), shard.keys() - set(names)
        if missing or extra:
            raise RuntimeError(f"converted {kind} shard does not fit the model: missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(extra)[:5]}")
        # compact private copies: a slice may be a view into a full-size tensor of the reader, and
        # optimizer state must not alias anything (it is updated in place)
        out.update({f"{kind}{SEP}{global_name(n, offset)}": t.clone() for n, t in shard.items()})
    if engine.optimizer is not None and opt:
        for k in opt["scalar"]:
            if k != "step" or opt["step"] is None:
                raise ValueError(f"optimizer state {k!r} is a per-parameter scalar other than AdamW's step: "
                                 "it cannot be moved to another layout; load the checkpoint at its saved layout")
            for n in names:
                out[f"step{SEP}{global_name(n, offset)}"] = torch.tensor(opt["step"],
                                                                          dtype=getattr(torch, opt["step_dtype"]))
    return out


def apply_state(engine: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Put weights, masters, optimizer state, step_count and the count of non-finite steps in a row
    into the engine (byte copies when the dtypes agree)."""
    # (checkpoint names: experts under their global index)
    named = [(global_name(n, engine.experts_offset), p) for n, p in engine.named_trainable()]
    with torch.no_grad():
        for n, p in named:
            p.copy_(tensors[f"{PARAM}{SEP}{n}"])
        if engine.master is not None:
            for (n, _), m in zip(named, engine.master, strict=True):
                if m is not None:  # None: another DP rank keeps this master
                    m.copy_(tensors[f"{MASTER}{SEP}{n}"])
    opt = meta.get("optimizer")
    if engine.optimizer is not None:
        engine.optimizer.state.clear()
        if opt:
            group = engine.optimizer.param_groups[0]
            for i, (n, _) in enumerate(named):
                q = engine.optimizer_param(i)
                if q is None:  # another DP rank keeps and steps this parameter's state
                    continue
                state: dict[str, Any] = {}
                for k in [*opt["per_element"], *opt["scalar"]]:
                    t = tensors.get(f"{k}{SEP}{n}")
                    if t is not None:
                        state[k] = t.to(q.device) if t.dim() > 0 else t.clone()
                state.update(opt["other"].get(n, {}))
                if state:
                    engine.optimizer.state[q] = state
            for k, v in opt["param_groups"][0].items():
                group[k] = tuple(v) if k == "betas" else v
    engine.step_count = int(meta["step_count"])
    engine.nonfinite_in_a_row = int(meta.get("nonfinite_in_a_row", 0))  # 0 in a checkpoint from before it was saved


def _config_seed(ckpt_dir: Path) -> int:
    """trainer.seed of the run, from the checkpoint's config.yaml (0 when there is none)."""
    try:
        import yaml
        cfg = yaml.safe_load((ckpt_dir / "config.yaml").read_text())
        return int(cfg["trainer"]["seed"])
    except (OSError, KeyError, TypeError, ValueError):
        return 0


def load_engine(engine: Any, ckpt_dir: str | Path, role: str, rank: int, world_size: int,
                seed: int | None = None) -> dict[str, Any]:
    """Load `role`'s saved state into this rank's engine: its own file byte for byte when the
    layout is the one saved, else converted. Then the RNG states (restored in the same layout and
    world, reseeded otherwise). Returns a summary."""
    from safetensors.torch import load_file

    t0 = time.monotonic()
    root = Path(ckpt_dir)
    saved = SavedRole(root / role)
    cur_arch = asdict(engine.arch)
    if saved.meta0["arch"] != cur_arch:
        diff = {k: (saved.meta0["arch"].get(k), v) for k, v in cur_arch.items() if saved.meta0["arch"].get(k) != v}
        raise ValueError(f"{root / role}: saved from another model (saved vs current: {diff})")
    saved_lora, cur_lora = saved.meta0.get("lora"), _lora_meta(engine)
    if saved_lora != cur_lora:
        raise ValueError(f"{root / role}: saved with actor.lora {saved_lora or 'off'}, this run has "
                         f"{cur_lora or 'off'}; resume with the LoRA settings it was saved with")
    names = [global_name(n, engine.experts_offset) for n, _ in engine.named_trainable()]
    own = root / role / f"{_engine_stem(engine)}.json"
    own_meta = json.loads(own.read_text()) if own.is_file() else None
    exact = _same_layout(engine, own_meta, names)
    if exact:
        tensors = load_file(str(own.with_suffix(".safetensors")))
        apply_state(engine, tensors, own_meta)
    elif cur_lora is not None:
        lay = saved.meta0["layout"]
        raise ValueError(f"{root / role}: LoRA adapters saved at TP={lay['tp']} PP={lay['pp']} load at that layout "
                         f"only (this run: TP={engine.tp_size} PP={engine.pp_size}); export them with "
                         "`hpcrl ckpt export-hf RUN --lora` and start a run from them (actor.lora.adapters)")
    else:
        apply_state(engine, converted_tensors(engine, saved), saved.meta0)
    rng = restore_or_reseed(root, rank, world_size, exact, _config_seed(root) if seed is None else seed,
                            engine.step_count)
    lay = saved.meta0["layout"]
    return {"role": role, "step_count": engine.step_count, "converted": not exact, "rng": rng,
            "saved_layout": {"tp": lay["tp"], "pp": lay["pp"], "dp": lay["dp"], "cp": lay.get("cp", 1)},
            "layout": {"tp": engine.tp_size, "pp": engine.pp_size, "dp": engine.dp_size, "cp": engine.cp_size},
            "seconds": round(time.monotonic() - t0, 3)}


# the role's save / wait / load -----------------------------------------------------------------
class RoleCheckpointer:
    """Save and load of one MegatronRole's engine on one rank, with an optional background write.

    An async save snapshots everything to private CPU copies synchronously (the next step may
    then update the live tensors) and writes in a thread; `wait` returns the records. A new save
    or a load first waits for a write still in flight."""

    def __init__(self, engine: Any, role: str, model_path: str) -> None:
        self.engine = engine
        self.role = role
        self.model_path = model_path
        self._thread: threading.Thread | None = None
        self._records: list[FileRecord] = []
        self._error: BaseException | None = None

    @staticmethod
    def _rank() -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def nbytes(self) -> int:
        """~Bytes this rank's next save will write: its shard (DP x CP replica 0) and its RNG file."""
        rank, world = self._rank()
        shard = engine_nbytes(self.engine) if self.engine.is_checkpoint_writer else 0
        return shard + len(rng_blob(rank, world, capture_rng())) + FILE_SLACK

    def save(self, ckpt_dir: str, async_save: bool = False) -> list[FileRecord]:
        """Write this rank's files (shard on DP replica 0, RNG on every rank); their records, or []
        for an async save (collect them with `wait`)."""
        self.wait()
        rank, world = self._rank()
        # every DP rank takes part when the optimizer state is sharded: the writer gathers it
        others = self.engine.gather_optimizer_state()
        shard = engine_state(self.engine, self.role, self.model_path, copy=async_save, others=others) \
            if self.engine.is_checkpoint_writer else None
        key = str(Path(ckpt_dir).resolve())
        rng = None
        if key not in _rng_written:
            rng = capture_rng()
            _rng_written.add(key)

        def job() -> list[FileRecord]:
            records: list[FileRecord] = []
            if shard is not None:
                records += write_shard(shard, ckpt_dir, self.role)
            if rng is not None:
                records += write_rng(ckpt_dir, rank, world, rng)
            return records

        if not async_save:
            return job()

        def run() -> None:
            try:
                self._records = job()
            except BaseException as e:  # handed to the controller by wait()
                self._error = e

        self._records, self._error = [], None
        self._thread = threading.Thread(target=run, name=f"hpcrl-ckpt-{self.role}", daemon=False)
        self._thread.start()
        return []

    def wait(self) -> list[FileRecord]:
        """Records of the async save in flight (after it finished); [] when there is none."""
        if self._thread is None:
            return []
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, DiskFullError):  # keep the type: the controller tells it from a bug
                raise DiskFullError(f"async checkpoint write of {self.role}: {err}") from err
            raise RuntimeError(f"async checkpoint write of {self.role} failed: {err!r}") from err
        records, self._records = self._records, []
        return records

    def load(self, ckpt_dir: str, seed: int | None = None) -> dict[str, Any]:
        self.wait()
        rank, world = self._rank()
        return load_engine(self.engine, ckpt_dir, self.role, rank, world, seed)
