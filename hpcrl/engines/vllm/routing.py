"""The experts vLLM routes each token to, recorded while it generates (routing replay, "R3").

vLLM 0.32 returns routed experts (`enable_return_routed_experts`) only with its V2 model runner, which
needs Triton: not on the CPU. So hpcrl records them itself, inside the in-process engine: a forward
hook on every MoE layer's router (`mlp.gate`, whose output are the router logits of the tokens of the
step) takes the top-k experts of each token, and the model runner's batch layout of that step (its
requests, their query ranges and each token's position) says whose token at which position it was.
The top-k of the logits is the top-k of vLLM's routing weights (softmax is monotonic; both renormalise
or not after the selection, which leaves the choice alone).

The prefix cache is off with routing replay (RolloutEngine): a cached block may come from another
prompt that opens with the same tokens (the chat template's), whose routes are not this request's.
Should a prompt position still be missing (prefix caching turned back on through engine_kwargs),
`RoutingRecorder.routes` fills it from the other requests of the same prompt. The last sampled token
of a sequence is never fed back, so it has no routing: its row is -1 (the trainer routes it itself;
nothing after it is computed, so it changes no log-prob).

`install`, `take` and `remove` run inside vLLM's worker through `LLM.collective_rpc`.
"""

from __future__ import annotations

from typing import Any

import torch

_ATTR = "_hpcrl_routing"


def _host(buffer: Any) -> torch.Tensor:
    """A model-runner buffer's host tensor (a CpuGpuBuffer's `.cpu`; the CPU runner's are plain tensors)."""
    host = getattr(buffer, "cpu", None)
    return host if isinstance(host, torch.Tensor) else buffer


class RoutingRecorder:
    """Per engine step: the requests and each token's (request, position); per MoE layer and step,
    each token's top-k experts."""

    def __init__(self, runner: Any, layers: list[torch.nn.Module], topk: int):
        self.runner = runner
        self.topk = topk
        self.layers = len(layers)
        self.steps: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []  # (req ids, token -> req, positions)
        self.experts: list[list[torch.Tensor]] = []  # per step: per layer [tokens, k]
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            n = logits.shape[0]
            if layer == 0:
                batch = self.runner.input_batch
                reqs = list(batch.req_ids[:batch.num_reqs])
                starts = _host(self.runner.query_start_loc)[:len(reqs) + 1].clone()
                owner = torch.repeat_interleave(torch.arange(len(reqs)), starts.diff())
                if owner.numel() != n:  # a padded step (no real tokens there): keep the real ones
                    owner = torch.cat([owner, owner.new_full((n - owner.numel(),), -1)])[:n]
                positions = _host(self.runner.positions)[:n].clone()
                self.steps.append((reqs, owner, positions))
                self.experts.append([])
            self.experts[-1].append(logits.detach().float().topk(self.topk, dim=-1).indices.to(torch.int16).cpu())
        return hook

    def routes(self, requests: list[tuple[str, int, int, int]]) -> dict[str, torch.Tensor]:
        """For (request id, prompt group, sequence length, prompt length) each: [length, layers, k] int16
        experts of every position, -1 where no forward computed it. A prompt position that the prefix
        cache served to a request comes from the request of its group that computed it."""
        by_req: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for (reqs, owner, positions), layers in zip(self.steps, self.experts, strict=True):
            stacked = torch.stack(layers, dim=1)  # [tokens, layers, k]
            for i, req in enumerate(reqs):
                rows = (owner == i).nonzero().flatten()
                # vLLM's engine core names a request "<its id>-<8 random characters>"
                by_req.setdefault(req.rsplit("-", 1)[0], []).append((positions[rows], stacked[rows]))
        out: dict[str, torch.Tensor] = {}
        prompts: dict[int, torch.Tensor] = {}  # per group: its prompt's positions, from whoever computed them
        for req, group, length, prompt_length in requests:
            t = torch.full((length, self.layers, self.topk), -1, dtype=torch.int16)
            for pos, ex in by_req.get(req, []):
                keep = pos < length
                t[pos[keep].long()] = ex[keep]
            out[req] = t
            shared = prompts.setdefault(group, torch.full((prompt_length, self.layers, self.topk), -1,
                                                          dtype=torch.int16))
            fill = (shared[:, 0, 0] < 0) & (t[:prompt_length, 0, 0] >= 0)
            shared[fill] = t[:prompt_length][fill]
        for req, group, _length, prompt_length in requests:
            t, shared = out[req], prompts[group]
            missing = t[:prompt_length, 0, 0] < 0
            t[:prompt_length][missing] = shared[missing]
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE decoder layer, in layer order (Qwen3-MoE: `model.layers[i].mlp.gate`)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def install(worker: Any, topk: int) -> int:
    """Start recording (a new recording replaces the last one); returns the MoE layers hooked."""
    remove(worker)
    runner = worker.model_runner
    recorder = RoutingRecorder(runner, moe_gates(runner.model), topk)
    setattr(worker, _ATTR, recorder)
    return recorder.layers


def take(worker: Any, requests: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
    """The routes of these requests (`RoutingRecorder.routes`), and a fresh recording."""
    recorder: RoutingRecorder = getattr(worker, _ATTR)
    out = recorder.routes(requests)
    recorder.steps.clear()
    recorder.experts.clear()
    return out


def remove(worker: Any) -> None:
    recorder = getattr(worker, _ATTR, None)
    if recorder is not None:
        recorder.close()
        delattr(worker, _ATTR)
