"""A reward model on the Megatron engine: a scalar score per sequence, added to the rule-based reward.

The model is a HF sequence-classification checkpoint with one label (e.g. Qwen2/Llama
`...ForSequenceClassification`, whose `score.weight` [1, hidden] reads the last token's hidden
state). It runs colocated with the actor, in the actor's TP/PP layout (megatron's parallel state is
per process), as the engine's value head loaded with `score.weight`.
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.controller import Collect, Dispatch, register
from hpcrl.controller.batch import Batch
from hpcrl.engines.megatron.convert import SafetensorsReader
from hpcrl.engines.megatron.engine import EngineOptions, MegatronEngine
from hpcrl.workers.batching import sequences
from hpcrl.workers.megatron_roles import MegatronRole
from hpcrl.workers.role_engines import resolve_dtype, use_layout


class RewardModelRole(MegatronRole):
    """One rank of the reward model (forward only)."""

    def __init__(self, cfg: dict[str, Any], model_path: str | None = None):
        par = cfg["actor"]["parallel"]
        use_layout(par["tensor_parallel"], par["pipeline_parallel"], seed=cfg["trainer"]["seed"],
                    cp=par.get("context_parallel", 1))
        a = cfg["actor"]
        self.role = "reward_model"
        self.model_path = model_path or cfg["reward"]["model_path"]
        self.section = a
        self.policy_loss = cfg["algorithm"]["policy_loss"]
        options = EngineOptions(dtype=resolve_dtype(cfg["model"]["dtype"]), attention=cfg["model"]["local_attention"],
                                micro_batch_tokens=a["micro_batch_tokens"], packing=a["packing"],
                                micro_batch_size=a["micro_batch_size"],
                                sequence_parallel=bool(par.get("sequence_parallel", False)))
        self.engine = MegatronEngine(self.model_path, options, value_head=True)
        if self.engine.model.post_process:
            reader = SafetensorsReader(self.model_path)
            if "score.weight" not in reader.keys():
                raise ValueError(f"reward.model_path={self.model_path}: no 'score.weight' tensor; a reward model is a "
                                 "sequence-classification checkpoint with one label")
            head = self.engine.model.output_layer
            with torch.no_grad():
                head.weight.copy_(reader("score.weight").reshape(head.weight.shape))
                head.bias.zero_()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
    def compute_scores(self, batch: Batch) -> torch.Tensor | None:
        """Score [B] of each whole sequence: the head applied to the hidden state of its last token.

        The engine returns one value per predicting position (the state before each next token);
        appending one throw-away token makes the last real token a predicting position. Causal
        attention keeps the earlier positions unaffected by it."""
        seqs = [torch.cat([s, s[-1:]]) for s in sequences(batch)]
        vals = self.engine.compute_values(seqs)
        if vals is None or not self.engine.is_output_rank:
            return None
        return torch.stack([v[-1] for v in vals]).float()
