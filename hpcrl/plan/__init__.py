"""Memory planning: does a run fit its devices? (`hpcrl plan`, docs/planner.md)

- `shape.py`: a model's shape from its HF config.json (Llama, Qwen2, Qwen3, Qwen3-MoE: total and
  active parameters), and the parameters each layout puts on one device (Megatron's TP x PP (x EP)
  shard of a pipeline stage, vLLM's rollout-TP shard).
- `activations.py`: the token and activation arithmetic: the tokens of a micro-batch, the
  activations of one layer by region, with context parallel, sequence parallel and recompute
  (`role_layer_activations`), the logits, vLLM's activation reserve and default CPU KV cache.
- `memory.py`: the bytes of one worker (one GPU, or one CPU worker process) in each phase of a step
  (rollout, reshard, forward, updates, optimizer step), term by term, from those and the roles'
  weights and optimizer state; with the split placement, of a trainer worker and of a rollout
  worker apart; no torch, no vLLM.
- `moe.py`: an MoE model's terms: the experts on one GPU under expert parallel (EP ranks carved from
  DP x CP, expert TP = TP), their optimizer state cut over the expert-DP ranks, the all-to-all token
  dispatcher's buffers; the EP checks and choices the plan and its suggestions use.
- `fsdp.py`: a role on the FSDP engine (actor.engine=fsdp): fp32 shards over DP (the masters),
  gradient shards, Adam moments, the gathered units, activations of the HF decoder with padded
  micro-batches, the reshard's full tensors; memory.py puts them where a Megatron role's terms are.
- `report.py`: what `hpcrl plan` prints after the layouts (table, peak, verdict, what to change),
  its options (--nodes, --gpus-per-node, --gpu-mem, --model-config, --compare) and exit statuses,
  and the comparison with the peaks a run measured (metrics.jsonl).
- `suggest.py`: what to change when a run does not fit, found by planning the config again with
  keys changed; the largest layouts that can be placed when the config's cannot.
"""

from hpcrl.plan.activations import (
    LayerActivations,
    kept_activation_bytes,
    layer_activations,
    role_layer_activations,
)
from hpcrl.plan.memory import Estimate, RoleShapes, estimate, estimate_rollout_worker
from hpcrl.plan.report import (
    EXIT_DOES_NOT_FIT,
    EXIT_STATUS_HELP,
    add_plan_arguments,
    cluster_for_plan,
    compare_with_run,
    memory_plan,
)
from hpcrl.plan.shape import ModelConfigError, ModelShape, read_model_shape

__all__ = [
    "EXIT_DOES_NOT_FIT", "EXIT_STATUS_HELP", "Estimate", "LayerActivations", "ModelConfigError", "ModelShape",
    "RoleShapes", "add_plan_arguments", "cluster_for_plan", "compare_with_run", "estimate", "estimate_rollout_worker",
    "kept_activation_bytes", "layer_activations", "memory_plan", "read_model_shape", "role_layer_activations",
]
