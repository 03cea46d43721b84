"""The engine's weights: loading HF and Megatron shards, this rank's shard (LoRA merged) and its layout,
the LoRA adapters and PEFT folders, HF export of a pipeline stage, and the device-memory offload.

`WeightsMixin` is part of `MegatronEngine` (hpcrl.engines.megatron.engine), which sets the attributes
it reads: `model`, `arch`, `spec`, `lora`, `value_head`, `master`, `optimizer`, `tp_rank`, `tp_size`,
`pp_rank`, `pp_size`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hpcrl.engines.megatron.convert import SafetensorsReader, global_expert_names, hf_to_megatron, megatron_to_hf
from hpcrl.engines.megatron.lora import MergedShard, adapters_from_hf, read_peft_folder


class WeightsMixin:
    """The weights' part of `MegatronEngine`."""

    def load_hf(self, model_path: str) -> None:
        """Load this shard from a HF folder, reading only the tensors it needs."""
        reader = SafetensorsReader(model_path)
        shard = hf_to_megatron(self.arch, reader, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size,
                               self.spec, lm_head=not self.value_head, ep_rank=self.ep_rank, ep_size=self.ep_size)
        if self.value_head and self.model.post_process:
            # a fresh head: the LM head's weights are not values
            shard.update({f"output_layer.{k}": v for k, v in self.model.output_layer.state_dict().items()})
        self.load_megatron_shard(shard)

    def load_megatron_shard(self, shard: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        params = {k for k in own if not k.endswith("_extra_state")}
        missing, unexpected = params - shard.keys(), shard.keys() - params
        if missing or unexpected:
            raise RuntimeError(f"weight shard does not fit the model: missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]}")
        with torch.no_grad():
            for k, v in shard.items():
                if own[k].shape != v.shape:
                    raise RuntimeError(f"{k}: checkpoint shape {tuple(v.shape)} != model {tuple(own[k].shape)}")
                own[k].copy_(v)

    def megatron_shard(self) -> Mapping[str, torch.Tensor]:
        """This rank's weights, megatron-named. With LoRA: the base names, adapted layers merged
        (W + scale B A, computed on access: see hpcrl.engines.megatron.lora.MergedShard)."""
        if self.lora is not None:
            return MergedShard(self.model, self.lora)
        return {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    def shard_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each `megatron_shard` tensor, without reading (or merging) any."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict(keep_vars=True).items()
                if not k.endswith("_extra_state") and ".lora_" not in k}

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of what the optimizer steps, in its order: what a checkpoint holds."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def adapter_shard(self) -> dict[str, torch.Tensor]:
        """This rank's LoRA tensors (megatron names `...<layer>.lora_A|B`)."""
        assert self.lora is not None, "engine built without LoRA"
        return {k: v.detach() for k, v in self.lora.adapter_params().items()}

    def load_adapters_peft(self, path: str) -> None:
        """Set the adapters from a PEFT LoRA folder (its rank must be actor.lora.rank)."""
        assert self.lora is not None, "engine built without LoRA"
        cfg, get = read_peft_folder(path)
        s = self.lora.settings
        if int(cfg.get("r", -1)) != s.rank or float(cfg.get("lora_alpha", -1)) != float(s.alpha):
            raise ValueError(f"{path}: adapter rank {cfg.get('r')} / alpha {cfg.get('lora_alpha')}, but "
                             f"actor.lora has rank {s.rank} / alpha {s.alpha}")
        shard = adapters_from_hf(self.arch, get, s.targets, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)
        own = self.lora.adapter_params()
        with torch.no_grad():
            for k, v in shard.items():
                if own[k].shape != v.shape:
                    raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the model's adapter "
                                     f"{tuple(own[k].shape)}")
                own[k].copy_(v)

    def export_hf_stage(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor] | None:
        """Gather the TP shards of this pipeline stage; TP rank 0 gets the stage's HF tensors.

        `tensors` (Megatron-named, laid out like the shard: e.g. recorded gradients) replaces the
        weights; a critic's value head comes back as value_head.weight / value_head.bias."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        source = self.megatron_shard() if tensors is None else tensors
        head = {k.replace("output_layer.", "value_head."): v.detach().cpu() for k, v in source.items()
                if self.value_head and k.startswith("output_layer.")}
        mine = {k: v.detach().cpu() for k, v in source.items() if not k.startswith("output_layer.")
                or not self.value_head}
        mine = global_expert_names(mine, self.experts_offset)
        if self.tp_size == 1:
            gathered = [mine]
        else:
            gathered = [None] * self.tp_size
            dist.all_gather_object(gathered, mine, group=ps.get_tensor_model_parallel_group())
        out = megatron_to_hf(self.arch, gathered, self.pp_rank, self.pp_size, self.spec) if self.tp_rank == 0 else {}
        if self.ep_size > 1:  # every EP rank's experts (the rest of the stage is the same on all)
            parts: list[dict[str, torch.Tensor] | None] = [None] * self.ep_size
            dist.all_gather_object(parts, out, group=ps.get_expert_model_parallel_group())
            out = {k: v for part in parts for k, v in part.items()}
        if self.tp_rank != 0:
            return None
        if tensors is not None:
            out.update(head)  # the weights' export (HF folders) has no place for a value head
        return out

    # device memory -----------------------------------------------------------------------------
    def offload(self) -> bool:
        """Move parameters, gradients and optimizer state to pinned host memory, so the colocated
        rollout engine can use the device memory. No-op (False) without CUDA."""
        return self._move("cpu")

    def onload(self) -> bool:
        """Bring everything `offload` moved back onto this rank's GPU."""
        return self._move(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")

    def _move(self, device: str) -> bool:
        if not torch.cuda.is_available():
            return False

        def to(t: torch.Tensor) -> torch.Tensor:
            if device == "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                return host.copy_(t.detach(), non_blocking=True)
            return t.to(device, non_blocking=True)

        for p in self.model.parameters():
            p.data = to(p.data)
            p.grad = None  # gradients are dead between steps
            if hasattr(p, "main_grad"):
                p.main_grad = to(p.main_grad)
        for m in self.master or []:
            if m is not None:
                m.data = to(m.data)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        state[k] = to(v)
        torch.cuda.synchronize()
        if device == "cpu":
            torch.cuda.empty_cache()
        return True
