"""The memory planner (hpcrl.plan, `hpcrl plan`): the per-term arithmetic against numbers worked
out by hand from the formulas in docs/planner.md, the verdicts and exit statuses of the command.

Fast: no MPI, no torch; the subprocess tests run the `hpcrl` command (about a second each).
"""

from __future__ import annotations

import json
import re
import struct

import pytest
from conftest import IN_CI, REPO, SMOLLM2, TINY_MODEL, hpcrl_cli

from hpcrl.config import load_config, validate
from hpcrl.plan import (
    RoleShapes,
    estimate,
    estimate_rollout_worker,
    kept_activation_bytes,
    read_model_shape,
    role_layer_activations,
)
from hpcrl.plan.activations import GIB, stored_activation_elements_per_token
from hpcrl.plan.memory import (
    CPU_PROCESS_OVERHEAD_BYTES,
    CPU_TRAINER_PROCESS_OVERHEAD_BYTES,
    GPU_RUNTIME_RESERVE_BYTES,
)
from hpcrl.plan.moe import DISPATCH_LABEL, expert_shard_params
from hpcrl.plan.shape import ModelConfigError, megatron_shard_params, shape_from_hf_config, vllm_shard_params

TINY = "configs/grpo_tiny.yaml"
PPO_70B = "configs/ppo_70b.yaml"
LLAMA3_70B = REPO / "configs" / "models" / "llama3-70b.json"


def safetensors_numel(path) -> int:
    """Elements of every tensor in a .safetensors file, from its JSON header (no torch)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, meta in header.items():
        if name != "__metadata__":
            numel = 1
            for d in meta["shape"]:
                numel *= d
            total += numel
    return total


# Tiny Qwen2 (models/tiny-qwen2/config.json): hidden 128, 2 layers, 4 heads / 2 KV heads of 32,
# FFN 512, vocab 512, tied embeddings, q/k/v biases. By hand, one layer: q 128x128 + k 128x64 +
# v 128x64 + o 128x128 = 49152, biases 128 + 64 + 64 = 256, MLP 3 x 128 x 512 = 196608, two norms
# 256: 246272. Model: embedding 512 x 128 = 65536 + 2 layers + final norm 128 = 558208.
TINY_LAYER_PARAMS = 49152 + 256 + 196608 + 256
TINY_PARAMS = 65536 + 2 * TINY_LAYER_PARAMS + 128
# the shape keys of the config.json `make models` writes for models/tiny-qwen2 (tools/), for when it
# is not built yet
TINY_HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
           "tie_word_embeddings": True, "max_position_embeddings": 4096}


def built(path) -> bool:
    """Whether `make models` built `path`. Outside CI a check of a model file is left out without it;
    under CI=true (make test builds the models) its absence fails the test instead of passing it."""
    if path.exists():
        return True
    if IN_CI:
        pytest.fail(f"{path} not built (make models)")
    return False


def tiny_shape():
    """models/tiny-qwen2's shape: from its config.json when built, else from TINY_HF."""
    if built(TINY_MODEL):
        shape = read_model_shape(TINY_MODEL)
        assert shape == shape_from_hf_config(TINY_HF, shape.source)
        return shape
    return shape_from_hf_config(TINY_HF, "TINY_HF")


def test_tiny_parameter_count_by_hand_and_from_the_weights() -> None:
    shape = tiny_shape()
    assert shape.layer_params() == TINY_LAYER_PARAMS == 246272
    assert shape.total_params() == TINY_PARAMS == 558208
    weights = TINY_MODEL / "model.safetensors"
    if built(weights):
        assert safetensors_numel(weights) == TINY_PARAMS
    if built(SMOLLM2 / "model.safetensors"):
        assert read_model_shape(SMOLLM2).total_params() == safetensors_numel(SMOLLM2 / "model.safetensors")


def test_llama3_70b_shape_and_shards_by_hand() -> None:
    shape = read_model_shape(LLAMA3_70B)
    # one layer: q and o 8192 x 8192 each, k and v 8192 x 1024 each, MLP 3 x 8192 x 28672, 2 norms
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert shape.layer_params() == layer == 855_654_400
    assert shape.total_params() == 2 * 128256 * 8192 + 80 * layer + 8192 == 70_553_706_496
    # TP=8 PP=8, stage 0: 10 layers with the linear weights split 8 ways and the norms replicated,
    # plus an eighth of the embedding
    stage0 = 10 * ((layer - 2 * 8192) // 8 + 2 * 8192) + 128256 // 8 * 8192
    assert megatron_shard_params(shape, 8, 8, 0) == stage0 == 1_201_045_504
    # the last stage: the final norm and an eighth of the LM head instead of the embedding; a
    # critic's value head (hidden + 1) instead of the LM head
    assert megatron_shard_params(shape, 8, 8, 7) == stage0 + 8192
    assert megatron_shard_params(shape, 8, 8, 7, head="value") == stage0 - 128256 // 8 * 8192 + 8192 + 8193
    # vLLM at rollout TP=8: one KV head per rank; vocabulary already a multiple of 64
    assert vllm_shard_params(shape, 8, separate_lm_head=False) == (
        80 * (8192 * (1024 + 2 * 128) + 1024 * 8192 + 3 * 8192 * 28672 // 8 + 2 * 8192) + 8192 + 2 * 16032 * 8192)


def test_shards_add_up_to_the_model() -> None:
    """Summed over TP ranks and stages, the shards are the model plus what Megatron replicates: the
    norms on every TP rank, and with tied embeddings and PP > 1 the last stage's copy of the embedding."""
    shape = tiny_shape()
    h, layers = shape.hidden_size, shape.num_layers
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        total = tp * sum(megatron_shard_params(shape, tp, pp, s) for s in range(pp))
        replicated_norms = (tp - 1) * (2 * h * layers + h)
        tied_copy = tp * (shape.vocab_size // tp * h) if pp > 1 else 0
        assert total == shape.total_params() + replicated_norms + tied_copy, (tp, pp)


def test_tiny_cpu_terms_by_hand() -> None:
    """grpo_tiny (CPU, fp32, actor TP=2 on 4 workers, rollout TP=1), each term worked out by hand."""
    cfg = load_config(REPO / TINY)
    validate(cfg)
    est = estimate(cfg, RoleShapes(policy=tiny_shape()), host_mem_bytes=3 << 30, host_mem_source="test")
    phases = {p.name: p.terms for p in est.phases}
    assert list(phases) == ["rollout", "reshard", "forward", "update actor", "optimizer step"]
    # TP=2 shard: 2 layers of (246272 - 256 replicated norm weights) / 2 + 256, half the embedding
    # (tied: one weight at PP=1), the final norm
    shard = 2 * ((TINY_LAYER_PARAMS - 256) // 2 + 256) + 512 // 2 * 128 + 128
    assert shard == 279424
    update = phases["update actor"]
    assert update["actor weights (fp32)"] == 4 * shard
    assert update["actor gradients (fp32 .grad)"] == 4 * shard
    # Adam's moments cut over the 2 DP ranks (actor.optim.shard_over_dp): half the shard each
    assert update["actor Adam moments (2 x fp32)"] == 8 * shard // 2
    assert "actor gradients (fp32 .grad)" not in phases["rollout"]  # dropped after each optimizer step
    # micro-batch: max(actor.micro_batch_tokens 2048, a full sequence 128 + 16) = 2048 tokens; one in
    # flight (PP=1); per token and layer 4h + (2 q_dim + 2 kv_dim) / tp + 4 I / tp (unfused gate on CPU)
    # in fp32, and the attention kernel's softmax statistics, one fp32 per head of the TP shard
    per_token_layer = 4 * 128 + (2 * 128 + 2 * 64) // 2 + 4 * 512 // 2
    assert update["activations kept for backward"] == 2048 * 2 * (per_token_layer * 4 + 4 // 2 * 4) == 28_344_320
    assert update["working set of one layer"] == 2048 * (5 * 128 + 3 * 512 // 2) * 4
    # logits at (at most) every position of the micro-batch, over half the vocabulary: the fp32 output
    # and its fp32 / temperature copy
    assert update["logits at response positions"] == 2048 * 256 * (4 + 4)
    assert update["process: torch+megatron+vLLM (measured)"] == CPU_PROCESS_OVERHEAD_BYTES
    # vLLM: the whole model in fp32 (rollout TP=1) with its own LM head on CPU
    assert phases["rollout"]["vLLM weights (rollout TP=1)"] == 4 * (TINY_PARAMS + 512 * 128)
    # KV cache, hpcrl.workers.actor_rollout's rule: 8 samples per replica (32 / 4 replicas; validation
    # 32 / 4 too) x 160 tokens (144 rounded up to 32-token blocks) x 1024 bytes a token (2 layers x
    # K and V x 2 KV heads x 32 x 4 bytes) x 1.25 = 1.6 MiB, below the floor of 1/16 GiB
    assert est.kv.bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert phases["rollout"]["vLLM KV cache"] == GIB // 16
    # the optimizer step: gradients all-reduced in place, fused Adam; a temporary of the largest
    # tensor, the TP shard of the fused [gate, up] projection: 2 x 512 / 2 x 128
    assert phases["optimizer step"]["optimizer temporaries"] == 4 * 2 * 512 // 2 * 128
    assert est.peak.name == "rollout"
    # every DP rank keeping every moment (shard_over_dp=false): the whole shard's
    cfg.actor.optim.shard_over_dp = False
    whole = estimate(cfg, RoleShapes(policy=tiny_shape()), host_mem_bytes=3 << 30, host_mem_source="test")
    assert {p.name: p.terms for p in whole.phases}["update actor"]["actor Adam moments (2 x fp32)"] == 8 * shard


def test_smollm2_kv_cache_matches_the_recipe_comment() -> None:
    if not SMOLLM2.exists():  # make test builds it: under CI=true its absence is a failure
        (pytest.fail if IN_CI else pytest.skip)("models/smollm2-135m-instruct not built (make models)")
    cfg = load_config(REPO / "configs" / "grpo_smollm2.yaml")
    est = estimate(cfg, RoleShapes(policy=read_model_shape(SMOLLM2)))
    # 32 validation prompts per replica x 320 tokens (10 blocks of 32) x 46080 bytes a token (30
    # layers x K and V x 3 KV heads x 64 x 4 bytes) x 1.25 = 0.55 GiB (configs/grpo_smollm2.yaml)
    assert est.kv.nbytes == int(1.25 * 32 * 320 * 30 * 2 * 3 * 64 * 4)
    assert round(est.kv.nbytes / GIB, 2) == 0.55
    assert est.fits is None  # no memory size given: no verdict


def test_gpu_terms_by_hand_70b_32_nodes() -> None:
    cfg = load_config(REPO / PPO_70B)
    validate(cfg)
    est = estimate(cfg, RoleShapes(policy=read_model_shape(LLAMA3_70B)), gpu_mem_bytes=80 * GIB)
    assert (est.stage, est.pipeline_stages, est.dtype) == (0, 8, "bf16")
    phases = {p.name: p.terms for p in est.phases}
    stage0 = 1_201_045_504
    update = phases["update actor"]
    # 9 bytes a parameter for each trained role: bf16 weights, fp32 main_grad, and the fp32 masters
    # and Adam 2 x fp32 cut over DP=4 (32 nodes x 8 GPUs / TP 8 / PP 8)
    for role in ("actor", "critic"):
        assert update[f"{role} weights (bf16)"] == 2 * stage0
        assert update[f"{role} gradients (fp32 main_grad)"] == 4 * stage0
        assert update[f"{role} master weights (fp32)"] == 4 * stage0 // 4
        assert update[f"{role} Adam moments (2 x fp32)"] == 8 * stage0 // 4
    assert update["reference weights (bf16)"] == 2 * stage0
    # 1F1B: stage 0 of 8 keeps 8 micro-batches of 4096 tokens over its 10 layers; per token and layer
    # 4h + (2 q_dim + 2 kv_dim) / 8 + 3 I / 8 elements (fused gate on GPU), 2 bytes each, and the flash
    # attention's softmax statistics, 64 / 8 heads x 4 bytes
    per_token_layer = 4 * 8192 + (2 * 8192 + 2 * 1024) // 8 + 3 * 28672 // 8
    assert update["activations kept for backward"] == 8 * 10 * 4096 * (per_token_layer * 2 + 64 // 8 * 4)
    assert update["CUDA context, NCCL, cuBLAS (assumed)"] == GPU_RUNTIME_RESERVE_BYTES
    # while generating the actor is in host memory (actor.offload: true)
    assert not any(k.startswith("actor ") for k in phases["rollout"])
    # vLLM's rule: KV = 0.6 x 80 GiB - weights - activation reserve
    rollout = phases["rollout"]
    assert rollout["vLLM KV cache"] == int(0.6 * 80 * GIB - rollout["vLLM weights (rollout TP=8)"]
                                           - rollout["vLLM activation reserve"])
    assert est.kv.bytes_per_token == 80 * 2 * 1 * 128 * 2
    assert est.kv.sequences >= 1
    assert est.fits and est.peak.total <= 80 * GIB


def test_lora_plans_adapter_optimizer_state_and_no_reference_copy() -> None:
    """70B with LoRA rank 16 on every linear layer: the optimizer terms count the adapters of the
    stage (by hand from the shard shapes), the base stays bf16 weights only, no reference copy."""
    cfg = load_config(REPO / PPO_70B, ["actor.lora.rank=16"])
    validate(cfg)
    est = estimate(cfg, RoleShapes(policy=read_model_shape(LLAMA3_70B)), gpu_mem_bytes=80 * GIB)
    update = {p.name: p.terms for p in est.phases}["update actor"]
    stage0, r, h, tp = 1_201_045_504, 16, 8192, 8
    # per layer: qkv A [r, h] + B [(8192 + 2 x 1024) / TP, r]; fc1 A [r, h] + B [2 x 28672 / TP, r];
    # proj A [r, 8192 / TP] + B [h, r]; fc2 A [r, 28672 / TP] + B [h, r]; 10 layers on stage 0 of 8
    adapters = 10 * (r * h + (8192 + 2048) // tp * r + r * h + 2 * 28672 // tp * r
                     + r * 8192 // tp + h * r + r * 28672 // tp + h * r)
    assert update["actor weights (bf16)"] == 2 * (stage0 + adapters)
    # masters and moments cut over DP=4
    assert update["actor master weights (fp32)"] == 4 * -(-adapters // 4)
    assert update["actor Adam moments (2 x fp32)"] == 8 * -(-adapters // 4)
    assert update["actor gradients (fp32 main_grad)"] == 4 * adapters
    assert not any(k.startswith("reference ") for k in update)
    full = estimate(load_config(REPO / PPO_70B), RoleShapes(policy=read_model_shape(LLAMA3_70B)),
                    gpu_mem_bytes=80 * GIB)
    full_update = {p.name: p for p in full.phases}["update actor"].total
    lora_update = {p.name: p for p in est.phases}["update actor"].total
    # the actor's 4 + 12 / 4 bytes a parameter beyond its weights, and the reference's 2, less the
    # adapters' 2 + 4 + 12 / 4
    assert full_update - lora_update == 9 * stage0 - (2 * adapters + 4 * adapters + 12 * -(-adapters // 4))


def _plan(*options: str, overrides: tuple[str, ...] = ()):
    """`hpcrl plan` of the 70B recipe with the Llama-3-70B shape (overrides follow the config)."""
    return hpcrl_cli("plan", PPO_70B, *overrides, "--skip-path-checks", "--model-config", str(LLAMA3_70B),
                     *options)


def test_cli_70b_fits_on_32_nodes_and_not_on_4() -> None:
    r = _plan("--nodes", "32", "--gpus-per-node", "8", "--gpu-mem", "80")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verdict     fits" in r.stdout and "llama3-70b.json (--model-config)" in r.stdout
    # the masters and moments cut over DP=4: generating (vLLM's weights and KV cache) is the peak
    assert "GiB per GPU, pipeline stage 0 of 8" in r.stdout and "peak        rollout: 62.30 GiB" in r.stdout
    assert "cut over the actor's 4 DP ranks (actor.optim.shard_over_dp)" in r.stdout
    assert "holds at least one full sequence" in r.stdout

    r = _plan("--nodes", "4", "--gpus-per-node", "8", "--gpu-mem", "80")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "does not fit on 4 node(s)" in r.stdout
    # the recipe's data_parallel cross-check is named, and the layout problem with its keys
    assert "actor.parallel.data_parallel=4" in r.stdout and "actor.parallel.pipeline_parallel=8" in r.stdout
    assert "--nodes 8" in r.stdout  # the fewest that place TP=8 x PP=8
    assert "does not fit" in r.stdout.splitlines()[-1]  # the largest layout that 32 GPUs can take does not either


def test_cli_data_parallel_is_re_derived_for_other_node_counts() -> None:
    r = _plan("--nodes", "16", "--gpu-mem", "80")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "actor.parallel.data_parallel=4 is for the recipe's 256 workers; re-derived as 2" in r.stdout
    assert "actor       TP=8 PP=8 DP=2" in r.stdout


def test_cli_does_not_fit_names_what_to_change() -> None:
    # the recipe's earlier settings: PP=4 and 16384-token micro-batches
    r = _plan("--gpu-mem", "80", overrides=(
        "actor.parallel.pipeline_parallel=4", "actor.parallel.data_parallel=8", "critic.parallel.pipeline_parallel=4",
        "critic.parallel.data_parallel=8", "actor.micro_batch_tokens=16384", "critic.micro_batch_tokens=16384"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "verdict     does not fit: update actor needs" in r.stdout
    # with the optimizer state cut over DP=8, smaller micro-batches alone are enough (PP stays 4)
    assert "what to change" in r.stdout
    assert "actor.micro_batch_tokens=4096 critic.micro_batch_tokens=4096: peak 70.09 GiB (rollout), fits" in r.stdout


@pytest.mark.parametrize("bad", ["0", "-80", "abc", "nan", "inf"])
def test_cli_refuses_a_bad_gpu_mem(bad: str) -> None:
    r = _plan("--gpu-mem", bad)
    assert r.returncode == 2
    assert "argument --gpu-mem: must be the memory of one GPU in GiB" in r.stderr and repr(bad) in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_model_config_says_to_pass_model_config() -> None:
    r = hpcrl_cli("plan", PPO_70B, "--skip-path-checks")  # /models/... is not on this machine
    assert r.returncode == 0 and "MPI world of 257" in r.stdout  # the layouts are still planned
    assert "no memory plan" in r.stderr and "pass --model-config PATH" in r.stderr
    r = _plan("--model-config", "/nonexistent/config.json")
    assert r.returncode == 2 and "--model-config: /nonexistent/config.json: no such file" in r.stderr


def test_cli_compare_with_a_run(tmp_path) -> None:
    if not SMOLLM2.exists():  # make test builds it: under CI=true its absence is a failure
        (pytest.fail if IN_CI else pytest.skip)("models/smollm2-135m-instruct not built (make models)")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, gb in enumerate([4.6, 4.3, 4.4, 4.35, 4.4], start=1):
            f.write(json.dumps({"step": step, "memory/rss_gb_max": gb}) + "\n")
    r = hpcrl_cli("plan", "configs/grpo_smollm2.yaml", "--compare", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "measured vs estimated (memory/rss_gb_max" in r.stdout
    assert "step    2: measured 4.30 GB" in r.stdout and "median measured / estimated over steps >= 2" in r.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    r = hpcrl_cli("plan", "configs/grpo_smollm2.yaml", "--compare", str(empty))
    assert r.returncode == 1 and "no step with memory/rss_gb_max" in r.stderr


def test_dpo_plans_no_rollout_engine() -> None:
    """DPO (hpcrl.trainer.dpo) builds no vLLM engine: no rollout or reshard phase, no KV cache line."""
    r = hpcrl_cli("plan", "configs/dpo_tiny.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "algorithm   dpo (sigmoid loss" in r.stdout and "vLLM weights" not in r.stdout
    assert "KV cache" not in r.stdout and "reshard" not in r.stdout
    assert "peak        update actor" in r.stdout and "verdict     fits" in r.stdout


def test_split_placement_plans_trainer_and_rollout_workers_apart() -> None:
    """trainer.placement=split on grpo_tiny (workers 1-2 train at TP=2, workers 3-4 run an engine
    each): a trainer worker holds no vLLM and sends the weights; a rollout worker holds vLLM alone
    and receives them. Each term by hand."""
    cfg = load_config(REPO / TINY, ["trainer.placement=split", "trainer.rollout_workers=2"])
    validate(cfg)
    shapes = RoleShapes(policy=tiny_shape())
    trainer = estimate(cfg, shapes, host_mem_bytes=3 << 30, host_mem_source="test")
    rollout = estimate_rollout_worker(cfg, shapes, host_mem_bytes=3 << 30, host_mem_source="test")
    assert (trainer.kind, rollout.kind) == ("trainer worker", "rollout worker")
    t = {p.name: p.terms for p in trainer.phases}
    assert list(t) == ["transfer", "forward", "update actor", "optimizer step"]
    assert not any(label.startswith("vLLM") for terms in t.values() for label in terms)
    assert t["update actor"]["actor weights (fp32)"] == 4 * 279424  # the TP=2 shard of the colocated test
    # rank 0 holds a bucket's TP parts, their HF conversion and the flat copy it sends: 3 buckets of
    # rollout.weight_bucket_mb = 16 MiB (larger than any conversion unit of the tiny model)
    assert t["transfer"]["transfer bucket: TP parts, HF copy, send buffer"] == 3 * (16 << 20)
    assert t["update actor"]["process: torch+megatron (measured)"] == CPU_TRAINER_PROCESS_OVERHEAD_BYTES
    r = {p.name: p.terms for p in rollout.phases}
    assert list(r) == ["rollout", "receive"]
    assert not any(label.startswith("actor") for terms in r.values() for label in terms)
    assert r["rollout"]["vLLM weights (rollout TP=1)"] == 4 * (TINY_PARAMS + 512 * 128)
    assert r["receive"]["received bucket"] == 16 << 20
    # the reload's largest rebuilt layer on CPU: embedding and LM head anew plus the LM head's packed
    # copy, 3 x 512 x 128 x 4 bytes
    assert r["receive"]["vLLM reload: the largest layer rebuilt"] == 3 * 512 * 128 * 4
    assert r["rollout"]["process: torch+megatron+vLLM (measured)"] == CPU_PROCESS_OVERHEAD_BYTES
    # capacity per worker: 3 GiB / 4 workers for both kinds
    assert trainer.capacity_bytes == rollout.capacity_bytes == (3 << 30) // 4
    assert trainer.fits and rollout.fits


def test_split_placement_with_the_fsdp_engine_plans_the_gathered_bucket() -> None:
    """trainer.placement=split with actor.engine=fsdp (2 trainer workers, DP=2): every trainer rank
    all-gathers each bucket's full tensors (fp32: the tiny model's largest bucket under 16 MiB is the
    whole model, 2.2 MB), and rank 0 sends a flat copy of it; no Megatron TP parts or conversion."""
    cfg = load_config(REPO / TINY, ["trainer.placement=split", "trainer.rollout_workers=2", "actor.engine=fsdp",
                                    "actor.parallel.tensor_parallel=1"])
    validate(cfg)
    trainer = estimate(cfg, RoleShapes(policy=tiny_shape()), host_mem_bytes=3 << 30, host_mem_source="test")
    t = {p.name: p.terms for p in trainer.phases}
    assert list(t)[0] == "transfer" and not any("vLLM" in label for terms in t.values() for label in terms)
    whole = 4 * TINY_PARAMS  # HF's tensors (tied embeddings: the LM head is the embedding, gathered once)
    assert t["transfer"]["reshard bucket: full tensors gathered (FSDP all-gather, fp32)"] == whole
    assert t["transfer"]["transfer send buffer (one bucket, flat)"] == whole
    assert "transfer bucket: TP parts, HF copy, send buffer" not in t["transfer"]


def test_split_kv_cache_is_sized_for_the_rollout_workers_only() -> None:
    """The KV cache each engine gets is sized by the engines there are (the rollout workers), not by
    all the workers: with one engine of two workers, the demo's validation batch of 64 prompts all
    goes to it, twice the colocated share."""
    if not SMOLLM2.exists():  # make test builds it: under CI=true its absence is a failure
        (pytest.fail if IN_CI else pytest.skip)("models/smollm2-135m-instruct not built (make models)")
    cfg = load_config(REPO / "configs" / "grpo_smollm2.yaml", ["trainer.placement=split", "trainer.rollout_workers=1"])
    validate(cfg)
    est = estimate_rollout_worker(cfg, RoleShapes(policy=read_model_shape(SMOLLM2)))
    assert est.kv.nbytes == int(1.25 * 64 * 320 * 30 * 2 * 3 * 64 * 4)
    assert est.kv.samples_per_engine == 32 and est.kv.val_per_engine == 64


def test_cli_split_prints_both_kinds_and_compares_each_with_its_ranks(tmp_path) -> None:
    split = ["trainer.placement=split", "trainer.rollout_workers=2"]
    r = hpcrl_cli("plan", TINY, *split)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "placement   split: workers 1-2 train, workers 3-4 run the vLLM engines" in r.stdout
    trainer_part, rollout_part = r.stdout.split("trainer workers: workers 1-2")[1].split("rollout workers: workers 3-4")
    assert "transfer" in trainer_part and "vLLM" not in trainer_part and "verdict     fits" in trainer_part
    assert "receive" in rollout_part and "actor" not in rollout_part and "verdict     fits" in rollout_part
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            ranks = {1: 0.5, 2: 0.6, 3: 0.9, 4: 0.7}
            f.write(json.dumps({"step": step, "memory/rss_gb_max": 0.9,
                                **{f"memory/rank{k}/rss_gb": v for k, v in ranks.items()}}) + "\n")
    r = hpcrl_cli("plan", TINY, *split, "--compare", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    trainer_cmp, rollout_cmp = r.stdout.split("measured vs estimated")[1:]
    assert "trainer workers: workers 1-2" in trainer_cmp and "step    2: measured 0.60 GB" in trainer_cmp
    assert "rollout workers: workers 3-4" in rollout_cmp and "step    2: measured 0.90 GB" in rollout_cmp


def test_cli_70b_split_gpu_plan() -> None:
    """The 70B recipe with half its 256 GPUs generating: the trainer's 128 GPUs keep the colocated
    update peak (it never held vLLM then) and hold 3 buckets on rank 0 while sending; an engine's GPU
    holds vLLM alone, its share of 0.6 x 80 GiB plus the runtime."""
    r = _plan("--gpu-mem", "80", overrides=("trainer.placement=split", "trainer.rollout_workers=128",
                                            "actor.parallel.data_parallel=null", "critic.parallel.data_parallel=null"))
    assert r.returncode == 0, r.stdout + r.stderr
    trainer_part, rollout_part = r.stdout.split("trainer workers: workers 1-128")[1].split(
        "rollout workers: workers 129-256")
    # the largest conversion unit, Llama-3-70B's embedding in bf16: 128256 x 8192 x 2 bytes = 1.96 GiB
    assert re.search(r"transfer bucket: TP parts, HF copy, send buffer +5\.87 ", trainer_part), trainer_part
    # 72.87 GiB before the masters and moments were cut over DP=2: less 2 x (2.24 + 4.47) for actor and critic
    assert "peak        update actor: 59.46 GiB" in trainer_part and "vLLM" not in trainer_part
    assert re.search(r"received bucket +- +1\.96\n", rollout_part), rollout_part
    assert "peak        rollout: 50.00 GiB" in rollout_part and "verdict     fits" in rollout_part


# -- long sequences: context parallel, sequence parallel, activation recompute (issue 38) ----------
QWEN_7B = REPO / "configs" / "models" / "qwen2.5-7b"  # folders holding a config.json only
QWEN_32B = REPO / "configs" / "models" / "qwen2.5-32b"
# 1024 prompt tokens + 31744 completion tokens = 32k-token samples, one per micro-batch, at TP=4
LONG_7B = ("model.path=configs/models/qwen2.5-7b", "trainer.device=cuda", "model.dtype=bf16",
           "data.max_prompt_length=1024", "rollout.max_new_tokens=31744", "actor.parallel.tensor_parallel=4",
           "rollout.tensor_parallel=4", "actor.micro_batch_tokens=32768")
# 16k-token samples at TP=8; the actor offloaded while vLLM generates (as every GPU run does today)
LONG_32B = ("trainer.device=cuda", "model.dtype=bf16", "data.max_prompt_length=1024", "rollout.max_new_tokens=15360",
            "actor.parallel.tensor_parallel=8", "rollout.tensor_parallel=8", "actor.micro_batch_tokens=16384",
            "actor.offload=true")


def test_qwen25_shapes_by_hand() -> None:
    """The shipped config.json folders: one layer q 3584 x 3584, k and v 3584 x 512 each (4 KV heads of
    128), o 3584 x 3584, the q/k/v biases, the MLP 3 x 3584 x 18944, two norms; untied embeddings."""
    shape = read_model_shape(QWEN_7B)
    layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
    assert shape.layer_params() == layer
    assert shape.total_params() == 2 * 152064 * 3584 + 28 * layer + 3584 == 7_615_616_512
    assert (shape.max_position_embeddings, shape.qkv_bias, shape.tie_word_embeddings) == (32768, True, False)
    big = read_model_shape(QWEN_32B)
    layer = 2 * 5120 * 5120 + 2 * 5120 * 1024 + (5120 + 2 * 1024) + 3 * 5120 * 27648 + 2 * 5120
    assert big.total_params() == 2 * 152064 * 5120 + 64 * layer + 5120 == 32_763_876_352


def _long_7b(*overrides: str):
    cfg = load_config(REPO / TINY, [*LONG_7B, "trainer.nnodes=2", "trainer.workers_per_node=8",
                                    "slurm.gpus_per_node=8", *overrides])
    validate(cfg)
    return cfg


def test_activation_terms_divide_by_cp_and_by_tp_in_the_norm_regions() -> None:
    """Qwen2.5-7B, one 32k-token sample, TP=4, bf16 on GPU (flash attention, fused gate): each term
    by hand; at CP=2 every term is half of CP=1's (a rank holds half of each sequence), and with
    sequence parallel the norm regions and the layer input are split over TP while the rest is not."""
    shape = read_model_shape(QWEN_7B)
    h, q, kv, ffn = 3584, 3584, 512, 18944
    one = role_layer_activations(_long_7b(), shape, gpu_mem_bytes=80 * GIB)
    t = 32768
    assert one.norm_region == t * 4 * h * 2  # replicated on the 4 TP ranks
    assert one.attention == t * (2 * q + 2 * kv) // 4 * 2
    assert one.mlp == t * 3 * ffn // 4 * 2
    assert one.core_attention == t * 28 // 4 * 4  # flash attention's fp32 softmax statistics
    assert one.layer_input == t * h * 2
    assert one.norm_region + one.attention + one.mlp == t * stored_activation_elements_per_token(shape, 4, True) * 2
    two = role_layer_activations(_long_7b("actor.parallel.context_parallel=2"), shape, gpu_mem_bytes=80 * GIB)
    for term in ("norm_region", "attention", "mlp", "core_attention", "layer_input"):
        assert 2 * getattr(two, term) == getattr(one, term), term
    sp = role_layer_activations(_long_7b("actor.parallel.sequence_parallel=true"), shape, gpu_mem_bytes=80 * GIB)
    assert 4 * sp.norm_region == one.norm_region and 4 * sp.layer_input == one.layer_input
    assert (sp.attention, sp.mlp, sp.core_attention) == (one.attention, one.mlp, one.core_attention)
    assert sp.total - sp.core_attention == t * stored_activation_elements_per_token(shape, 4, True, sp=True) * 2

    # the plan's row is these terms over the 28 layers of the one micro-batch in flight (PP=1)
    def kept(*overrides: str) -> int:
        est = estimate(_long_7b(*overrides), RoleShapes(policy=shape), gpu_mem_bytes=80 * GIB)
        return {p.name: p.terms for p in est.phases}["update actor"]["activations kept for backward"]

    assert kept() == 28 * one.total
    assert 2 * kept("actor.parallel.context_parallel=2") == kept()
    assert kept("actor.parallel.sequence_parallel=true") == 28 * sp.total


def test_recompute_keeps_less_selective_then_full() -> None:
    """selective drops the attention kernel's own state (on flash kernels only its softmax statistics,
    on the CPU's dense attention the [heads, T, T] probabilities); full keeps each layer's input and one
    layer's whole activations (the layer the backward re-runs)."""
    shape = read_model_shape(QWEN_7B)

    def kept(*overrides: str) -> int:
        est = estimate(_long_7b(*overrides), RoleShapes(policy=shape), gpu_mem_bytes=80 * GIB)
        return {p.name: p.terms for p in est.phases}["update actor"]["activations kept for backward"]

    acts = role_layer_activations(_long_7b(), shape, gpu_mem_bytes=80 * GIB)
    none, selective, full = (kept(f"actor.recompute={m}") for m in ("none", "selective", "full"))
    assert none - selective == 28 * acts.core_attention > 0
    assert full == 28 * acts.layer_input + acts.total
    assert full < selective < none
    assert kept_activation_bytes(acts, 28, 1, "full") == full
    # CPU, the tiny model's dense attention: selective drops the a / t x T^2 probabilities
    cpu = load_config(REPO / TINY, ["model.local_attention=dense"])
    dense = role_layer_activations(cpu, tiny_shape())
    assert dense.core_attention == 4 // 2 * 2048 * 2048 * 4
    assert dense.kept("selective") == dense.total - dense.core_attention < dense.kept("none")
    # (over 2 layers, re-running one layer with its T^2 probabilities keeps more than selective does)
    assert kept_activation_bytes(dense, 2, 1, "full") < kept_activation_bytes(dense, 2, 1, "none")


def _suggested(out: str, first_key: str) -> list[str]:
    """The overrides of the `what to change` line that starts with `first_key` (it must fit)."""
    line = next(x for x in out.splitlines() if x.startswith(f"  - {first_key}="))
    assert line.endswith(", fits"), line
    return line[4:].split(": peak")[0].split()


def test_cli_qwen7b_32k_fits_with_context_parallel_only(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2.5-7B at 32k-token samples on 2 nodes x 8 x 80 GB (model.path: a folder with config.json
    only, path checks on): 83.8 GiB at CP=1, over; the plan names CP=2, with which it fits."""
    from hpcrl.cli import main as cli_main

    monkeypatch.chdir(REPO)  # the recipe's data files are relative to the repo root
    argv = ["plan", TINY, *LONG_7B, "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem", "80"]
    assert cli_main(argv) == 3
    out = capsys.readouterr().out
    assert "actor       TP=4 PP=1 DP=4" in out and "qwen2.5-7b/config.json (model.path)" in out
    assert "verdict     does not fit: update actor needs 83.8" in out
    cp = _suggested(out, "actor.parallel.context_parallel")
    assert cp == ["actor.parallel.context_parallel=2"], cp  # alone, the smallest
    assert cli_main([*argv, *cp]) == 0
    out = capsys.readouterr().out
    assert "actor       TP=4 PP=1 CP=2 DP=2" in out and "verdict     fits" in out
    assert "micro-batches of 32768 tokens (actor), 16384 on each rank (context parallel CP=2)" in out


def test_cli_qwen32b_16k_fits_with_context_parallel_and_sequence_parallel(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2.5-32B at 16k-token samples on 4 nodes x 8 x 80 GB (--model-config: the folder): 103.6 GiB
    at CP=1, over. CP=2 halves the activations a rank keeps, and the optimizer state stays cut over
    the DP x CP replicas (as the engine cuts it): 70.0 GiB, fits; sequence parallel alone fits too."""
    from hpcrl.cli import main as cli_main

    argv = ["plan", TINY, *LONG_32B, "--skip-path-checks", "--model-config", str(QWEN_32B), "--nodes", "4",
            "--gpus-per-node", "8", "--gpu-mem", "80"]
    assert cli_main(argv) == 3
    first = capsys.readouterr().out
    assert "actor       TP=8 PP=1 DP=4" in first and "verdict     does not fit: update actor needs 103.6" in first
    cp = _suggested(first, "actor.parallel.context_parallel")
    assert cp == ["actor.parallel.context_parallel=2"], cp
    assert _suggested(first, "actor.parallel.sequence_parallel") == ["actor.parallel.sequence_parallel=true"]
    assert cli_main([*argv, *cp]) == 0
    out = capsys.readouterr().out
    assert "actor       TP=8 PP=1 CP=2 DP=2" in out and "verdict     fits" in out
    assert "masters and moments cut over the actor's 2 DP x 2 CP ranks" in out, out
    # the control: the optimizer state not cut (every replica holds all of it) does not fit at CP=2
    assert cli_main([*argv, *cp, "actor.optim.shard_over_dp=false"]) == 3
    capsys.readouterr()
    # and full recompute alone is named as well, and printed with the plan
    recompute = _suggested(first, "actor.recompute")
    assert recompute == ["actor.recompute=full"]
    assert cli_main([*argv, *recompute]) == 0
    assert "full recompute (actor.recompute=full" in capsys.readouterr().out


# -- mixture of experts: Qwen3-MoE, expert parallel ------------------------------------------------
QWEN3_30B_A3B = REPO / "configs" / "models" / "qwen3-30b-a3b"  # a folder holding a config.json only
TINY_QWEN3 = REPO / "models" / "tiny-qwen3"
TINY_QWEN3_MOE = REPO / "models" / "tiny-qwen3-moe"
# 4k-token samples (1024 + 3072), one per 4096-token micro-batch, TP=1 on 4 nodes x 8 GPUs (DP=32); the
# actor offloaded while vLLM generates (rollout TP=4)
MOE_30B = ("trainer.device=cuda", "model.dtype=bf16",
           "data.max_prompt_length=1024", "rollout.max_new_tokens=3072", "data.train_batch_size=32", "rollout.n=8",
           "actor.ppo_mini_batch_size=64", "actor.parallel.tensor_parallel=1", "rollout.tensor_parallel=4",
           "actor.micro_batch_tokens=4096", "actor.offload=true")


def test_qwen3_shapes_by_hand_and_from_the_weights() -> None:
    """Qwen3-30B-A3B (the shipped config.json): one layer's attention q 2048 x 4096, k and v 2048 x 512,
    o 4096 x 2048, no biases; q/k norms of head_dim 128 each; two norms; the router 128 x 2048; 128
    experts of 3 x 2048 x 768. Qwen's model card: 30.5 B parameters, 3.3 B active; within 2% of both."""
    shape = read_model_shape(QWEN3_30B_A3B)
    assert (shape.num_experts, shape.moe_intermediate_size, shape.num_experts_per_tok) == (128, 768, 8)
    assert shape.qk_norm and not shape.qkv_bias and not shape.tie_word_embeddings
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048
    expert = 3 * 2048 * 768
    layer = attention + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * expert
    assert shape.expert_params() == expert and shape.layer_params() == layer == 623_120_640
    total = 2 * 151936 * 2048 + 48 * layer + 2048
    assert shape.total_params() == total == 30_532_122_624
    assert shape.active_params() == total - 48 * (128 - 8) * expert == 3_353_032_704
    assert abs(shape.total_params() / 30.5e9 - 1) < 0.02 and abs(shape.active_params() / 3.3e9 - 1) < 0.02
    assert "MoE: 128 experts, top-8, 30.53 B total / 3.35 B active" in shape.describe()
    # vLLM at rollout TP=4: one KV head per rank, each expert's 768 split 4 ways, router and norms whole
    assert vllm_shard_params(shape, 4, separate_lm_head=False) == (
        48 * (2048 * (1024 + 2 * 128) + 1024 * 2048 + 128 * 3 * 2048 * 192 + 128 * 2048 + 2 * 2048 + 2 * 128)
        + 2048 + 2 * 151936 // 4 * 2048)
    # Megatron TP=2, PP=2, EP=8, stage 0: 24 layers of the attention split 2 ways, the norms and the router
    # whole, 16 experts of 3 x 2048 x 384; half the embedding
    assert megatron_shard_params(shape, 2, 2, 0, ep=8) == (
        24 * (attention // 2 + 2 * 128 + 2 * 2048 + 128 * 2048 + 16 * 3 * 2048 * 384) + 151936 // 2 * 2048)
    # a dense Qwen3 (Qwen3-8B's shape): q/k norms, no biases; 8.19 B as published
    dense = shape_from_hf_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 36,
                                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                  "intermediate_size": 12288, "vocab_size": 151936}, "Qwen3-8B")
    assert not dense.is_moe and dense.active_params() == dense.total_params() == 8_190_735_360
    # the tiny offline models: every tensor of their weights counted
    for folder in (TINY_QWEN3, TINY_QWEN3_MOE):
        if built(folder / "model.safetensors"):
            assert read_model_shape(folder).total_params() == safetensors_numel(folder / "model.safetensors"), folder


@pytest.mark.parametrize("extra, why", [
    ({"mlp_only_layers": [0]}, "MoE on some layers only"),
    ({"decoder_sparse_step": 2}, "MoE on some layers only"),
    ({"shared_expert_intermediate_size": 5632}, "shared experts"),
    ({"moe_intermediate_size": None}, "lacks moe_intermediate_size"),
])
def test_moe_configs_hpcrl_does_not_build_are_refused(extra, why) -> None:
    hf = json.loads((QWEN3_30B_A3B / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=why):
        shape_from_hf_config({**hf, **extra}, "test")


def _moe_30b(*overrides: str):
    cfg = load_config(REPO / TINY, [*MOE_30B, "trainer.nnodes=4", "trainer.workers_per_node=8",
                                    "slurm.gpus_per_node=8", *overrides])
    validate(cfg)
    return cfg


def test_expert_memory_per_rank_halves_from_ep1_to_ep2() -> None:
    """Qwen3-30B-A3B at TP=1, DP=32: EP=2 holds half of every layer's experts, so half the expert weights
    and gradients. Their masters and moments are cut over the expert-DP ranks (DP x CP / EP), so with
    ZeRO-1 a rank keeps the same of them at any EP; without it they halve too. The rest is unchanged."""
    shape = read_model_shape(QWEN3_30B_A3B)
    experts = 48 * 128 * 3 * 2048 * 768
    assert expert_shard_params(shape, 1, 1, 1) == experts == 2 * expert_shard_params(shape, 1, 2, 1)

    def update(*overrides: str) -> dict[str, int]:
        est = estimate(_moe_30b(*overrides), RoleShapes(policy=shape), gpu_mem_bytes=80 * GIB)
        return {p.name: p.terms for p in est.phases}["update actor"]

    one, two = update(), update("actor.parallel.expert_parallel=2")
    assert one["actor expert weights (bf16)"] == 2 * experts == 2 * two["actor expert weights (bf16)"]
    assert one["actor expert gradients (fp32 main_grad)"] == 4 * experts
    assert two["actor expert gradients (fp32 main_grad)"] == 4 * experts // 2
    # ZeRO-1: 1/32 of all experts at EP=1; none with EP > 1 (as the engine: the EP ranks of one DP group
    # step other experts), so all of the rank's half of them at EP=2
    masters, moments = "actor expert master weights (fp32)", "actor expert Adam moments (2 x fp32)"
    assert one[masters] == 4 * experts // 32 and two[masters] == 4 * experts // 2
    assert one[moments] == 8 * experts // 32 and two[moments] == 8 * experts // 2
    assert two["actor master weights (fp32)"] == 32 * one["actor master weights (fp32)"]
    for label in ("actor weights (bf16)", DISPATCH_LABEL, "activations kept for backward"):
        assert one[label] == two[label], label
    # the rest: embedding, LM head, final norm and 48 layers' attention, norms and routers
    assert one["actor weights (bf16)"] == 2 * (shape.total_params() - experts)
    unsharded = [update("actor.optim.shard_over_dp=false", f"actor.parallel.expert_parallel={ep}") for ep in (1, 2)]
    for label in (masters, moments):
        assert unsharded[0][label] == 2 * unsharded[1][label], label
    # the dispatcher and the experts' activations: 4096 tokens x 8 experts x (2 x 2048 permuted in and out
    # + 3 x 768 fused gate, up and down input) x 2 bytes, over the 48 layers of the one micro-batch in flight
    assert one[DISPATCH_LABEL] == 48 * 4096 * 8 * (2 * 2048 + 3 * 768) * 2
    # the dense MLP's activations are gone from the rest: 4h + (2 q + 2 kv) per token, and the softmax
    # statistics of 32 heads
    assert one["activations kept for backward"] == 48 * 4096 * ((4 * 2048 + 2 * 4096 + 2 * 512) * 2 + 32 * 4)
    # the peak per EP: without ZeRO-1 at EP > 1 every rank keeps all masters and moments of what it
    # holds, so EP=2 is worse than EP=1 and 32 is the smallest that fits
    peaks = {ep: estimate(_moe_30b(f"actor.parallel.expert_parallel={ep}"), RoleShapes(policy=shape),
                          gpu_mem_bytes=80 * GIB) for ep in (1, 2, 4, 8, 16, 32)}
    assert [round(e.peak.total / GIB, 2) for e in peaks.values()] == [214.69, 302.25, 180.75, 120.0, 89.62, 74.44]
    assert [e.fits for e in peaks.values()] == [False] * 5 + [True]


def test_dense_plans_are_unchanged_by_the_moe_terms() -> None:
    """Qwen2.5-7B at 32k (the long-sequence plan above): every phase's bytes as the planner gave them
    before MoE support, and no expert or dispatcher row."""
    est = estimate(_long_7b(), RoleShapes(policy=read_model_shape(QWEN_7B)), gpu_mem_bytes=80 * GIB)
    assert {p.name: p.total for p in est.phases} == {
        "rollout": 62_233_672_704, "reshard": 25_272_118_272, "forward": 33_846_623_232,
        "update actor": 90_008_878_080, "optimizer step": 19_828_997_120}
    assert not any("expert" in label or "MoE" in label for p in est.phases for label in p.terms)


def test_moe_layouts_megatron_refuses() -> None:
    """The tiny Qwen3-MoE (8 experts) on grpo_tiny: trained at TP=2 it needs sequence parallel; EP must
    divide the experts (validate checks that it divides DP x CP)."""
    moe_shape = (read_model_shape(TINY_QWEN3_MOE) if built(TINY_QWEN3_MOE / "config.json") else
                 shape_from_hf_config({**TINY_HF, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                       "num_hidden_layers": 4, "num_experts": 8, "moe_intermediate_size": 64,
                                       "num_experts_per_tok": 2, "tie_word_embeddings": False}, "tiny MoE"))

    def problems(*overrides: str) -> list[str]:
        cfg = load_config(REPO / TINY, list(overrides))
        validate(cfg)
        return estimate(cfg, RoleShapes(policy=moe_shape), host_mem_bytes=3 << 30, host_mem_source="test").problems

    assert any("sequence_parallel=true" in p for p in problems("actor.parallel.expert_parallel=2"))
    assert problems("actor.parallel.expert_parallel=2", "actor.parallel.sequence_parallel=true") == []
    # 3 workers at TP=1: DP=3, and 3 does not divide 8 experts
    three = ("trainer.workers_per_node=3", "actor.parallel.tensor_parallel=1", "data.train_batch_size=6",
             "actor.ppo_mini_batch_size=12")
    assert problems(*three) == []
    assert any("expert_parallel=3: must divide the model's 8 experts" in p
               for p in problems(*three, "actor.parallel.expert_parallel=3"))
    # the plan's suggestions keep sequence parallel on where they take an MoE model to TP > 1
    from hpcrl.plan.suggest import _with_valid_budgets

    cfg = load_config(REPO / TINY, list(three))
    assert _with_valid_budgets(cfg, {"actor.parallel.tensor_parallel": 2}, moe=True) == {
        "actor.parallel.tensor_parallel": 2, "actor.parallel.sequence_parallel": True}
    assert _with_valid_budgets(cfg, {"actor.parallel.tensor_parallel": 2}) == {"actor.parallel.tensor_parallel": 2}


def test_cli_qwen3_30b_a3b_fits_with_expert_parallel(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-30B-A3B on 4 nodes x 8 x 80 GB (--model-config: the folder): at EP=1 every GPU holds all 128
    experts of every layer, 172 GiB of expert state; the plan names EP=32 (4 experts a rank), the
    smallest EP that fits (no ZeRO-1 with EP > 1, as the engine), and with it the run fits."""
    from hpcrl.cli import main as cli_main

    monkeypatch.chdir(REPO)
    argv = ["plan", TINY, *MOE_30B, "--skip-path-checks", "--model-config", str(QWEN3_30B_A3B), "--nodes", "4",
            "--gpus-per-node", "8", "--gpu-mem", "80"]
    assert cli_main(argv) == 3
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b/config.json (--model-config): Qwen3MoeForCausalLM: MoE: 128 experts, top-8, 30.53 B total " \
           "/ 3.35 B active" in out
    assert "experts     EP=1: 128 experts a rank (of 128, top-8 a token)" in out
    assert "expert weights, gradients and optimizer state 172.12 GiB a rank" in out
    assert re.search(r"actor expert weights \(bf16\) +- +54\.00 ", out), out
    assert "verdict     does not fit: update actor needs 214.69 GiB" in out
    ep = _suggested(out, "actor.parallel.expert_parallel")
    assert ep == ["actor.parallel.expert_parallel=32"], ep
    assert cli_main([*argv, *ep]) == 0
    out = capsys.readouterr().out
    assert "actor       TP=1 PP=1 EP=32 DP=32" in out and "verdict     fits" in out
    assert "experts     EP=32: 4 experts a rank" in out
    assert "no other rank holds the same experts (DP x CP / EP = 1)" in out
    assert "expert weights, gradients and optimizer state 15.19 GiB a rank" in out
    assert "all-to-all dispatcher buffers and experts' activations 18.75 GiB kept for the backward" in out
    assert re.search(r"actor expert weights \(bf16\) +- +1\.69 ", out), out
    assert "peak        update actor: 74.44 GiB" in out


# -- the FSDP engine (actor.engine=fsdp, hpcrl/plan/fsdp.py) ---------------------------------------
SMOLLM2_RECIPE = "configs/grpo_smollm2.yaml"
FSDP_SHARD = "fp32 FSDP shard, 1/2"  # the demo's DP=2 (trainer.workers_per_node=2)


def _smollm2_shape():
    if not SMOLLM2.exists():  # make test builds it: under CI=true its absence is a failure
        (pytest.fail if IN_CI else pytest.skip)("models/smollm2-135m-instruct not built (make models)")
    return read_model_shape(SMOLLM2)


def _smollm2_phases(*overrides: str, gpu_mem_bytes: int | None = None) -> dict[str, dict[str, int]]:
    cfg = load_config(REPO / SMOLLM2_RECIPE, list(overrides))
    validate(cfg)
    est = estimate(cfg, RoleShapes(policy=_smollm2_shape()), gpu_mem_bytes=gpu_mem_bytes)
    return {p.name: p.terms for p in est.phases}


def test_fsdp_units_add_up_to_the_model() -> None:
    """The FSDP plan's tensors (root unit + one unit per layer) are the HF model's parameters; a critic
    drops the LM head (none when tied) and adds a value head of h + 1."""
    from hpcrl.plan.fsdp import FsdpRole

    shapes = [tiny_shape(), read_model_shape(LLAMA3_70B), read_model_shape(QWEN3_30B_A3B)]
    for shape in shapes:
        lm = FsdpRole("actor", shape, dp=8, compute_dtype="bf16", trains=True)
        value = FsdpRole("critic", shape, dp=8, compute_dtype="bf16", trains=True, head="value")
        head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
        assert lm.total_params == shape.total_params(), shape.source
        assert value.total_params == shape.total_params() - head + shape.hidden_size + 1, shape.source
        # one rank's shards: each tensor's rows cut 8 ways, rounded up
        assert shape.total_params() / 8 <= lm.params < shape.total_params() / 8 + 8 * 1024 * shape.num_layers


def test_fsdp_actor_state_is_the_megatron_plans_over_dp() -> None:
    """The demo (CPU, fp32, DP=2) with actor.engine=fsdp: the actor's weights, gradients and Adam
    moments are the Megatron plan's (TP=PP=1, every rank holding all of it) over DP=2; the FSDP rows
    by hand."""
    shape = _smollm2_shape()
    megatron = _smollm2_phases("actor.engine=megatron", "actor.optim.shard_over_dp=false")["update actor"]
    zero1 = _smollm2_phases("actor.engine=megatron")["update actor"]  # the recipe: moments cut over DP already
    phases = _smollm2_phases("actor.engine=fsdp")
    fsdp = phases["update actor"]
    assert fsdp[f"actor weights ({FSDP_SHARD})"] == megatron["actor weights (fp32)"] // 2 \
        == 4 * shape.total_params() // 2
    assert fsdp[f"actor gradients ({FSDP_SHARD})"] == megatron["actor gradients (fp32 .grad)"] // 2
    assert fsdp[f"actor Adam moments (2 x {FSDP_SHARD})"] == megatron["actor Adam moments (2 x fp32)"] // 2 \
        == zero1["actor Adam moments (2 x fp32)"]
    assert not any("master" in label for terms in phases.values() for label in terms)  # the shards are the masters
    # gathered in fp32 (the compute dtype): the root (embedding 49152 x 576, tied LM head, final norm),
    # one decoder layer, one all-gather buffer of a layer (CPU: no overlapped prefetch)
    root, layer = 49152 * 576 + 576, shape.layer_params()
    assert fsdp["actor gathered root: embedding, norm, LM head (FSDP all-gather, fp32)"] == 4 * root
    assert fsdp["actor gathered layer (FSDP all-gather, fp32)"] == 4 * layer
    assert fsdp["actor all-gather buffers (FSDP, fp32)"] == 4 * layer
    # the root's full gradients through the backward, then its fp32 reduce-scatter input (larger than a
    # layer's gradients and their reduce-scatter input)
    assert fsdp["actor unsharded gradients before reduce-scatter"] == 4 * root + max(8 * layer, 4 * root)
    # micro-batches of max(512, one full sequence of 320) padded tokens, 30 layers; per token and layer
    # 4h + 2q + 2kv + 4I (HF's unfused MLP) fp32 elements and 9 heads' softmax statistics: the Megatron
    # CPU plan's count at TP=1
    per_token_layer = 4 * 576 + 2 * 576 + 2 * 192 + 4 * 1536
    assert fsdp["activations kept for backward (HF layers, approximated)"] == 30 * 512 * (4 * per_token_layer + 9 * 4) \
        == megatron["activations kept for backward"]
    assert fsdp["logits at response positions (whole vocabulary)"] == 512 * 49152 * (4 + 4)
    # while generating: weights and moments stay (the engine does not offload), no gradients
    assert f"actor weights ({FSDP_SHARD})" in phases["rollout"]
    assert f"actor gradients ({FSDP_SHARD})" not in phases["rollout"]
    # the reshard: buckets of full fp32 tensors up to rollout.weight_bucket_mb = 256 MiB, filled tensor by tensor
    bucket = phases["reshard"]["reshard bucket: full tensors gathered (FSDP all-gather, fp32)"]
    assert (256 << 20) - 4 * 1536 * 576 < bucket <= 256 << 20
    assert "reshard bucket + converted copy" not in phases["reshard"]
    # the optimizer step: one fp32 temporary of the largest shard, half the embedding
    assert phases["optimizer step"]["optimizer temporaries"] == 4 * 49152 // 2 * 576


def test_fsdp_lora_trains_the_adapters_alone() -> None:
    """LoRA on the FSDP engine (rank 8, all-linear, DP=2): gradients and moments of the adapters' half
    only, the weights the base's half plus the adapters', no unsharded base gradients, no reference."""
    from hpcrl.plan.megatron import lora_shard_params

    shape = _smollm2_shape()
    full = _smollm2_phases("actor.engine=fsdp")["update actor"]
    lora = _smollm2_phases("actor.engine=fsdp", "actor.lora.rank=8")["update actor"]
    adapters = lora_shard_params(shape, 8, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), 1, 1)
    half = -(-adapters // 2)
    assert lora[f"actor weights ({FSDP_SHARD})"] == full[f"actor weights ({FSDP_SHARD})"] + 4 * half
    assert lora[f"actor gradients ({FSDP_SHARD})"] == 4 * half
    assert lora[f"actor Adam moments (2 x {FSDP_SHARD})"] == 8 * half
    assert lora["actor unsharded adapter gradients (LoRA, fp32)"] == 4 * adapters
    assert "actor unsharded gradients before reduce-scatter" not in lora
    assert not any(label.startswith("reference") for label in lora)


def test_fsdp_reshard_after_forward_false_keeps_a_full_copy() -> None:
    """reshard_after_forward=false (GPU, bf16): every layer stays gathered from its forward to its
    backward, which with the root is a full bf16 copy of the model in the update; a reference on FSDP
    keeps no copy between phases (the engine reshards after a no-grad forward)."""
    shape = _smollm2_shape()
    gpu = ("trainer.device=cuda", "model.dtype=bf16", "actor.engine=fsdp")
    resharded = _smollm2_phases(*gpu, gpu_mem_bytes=80 * GIB)
    kept = _smollm2_phases(*gpu, "actor.fsdp.reshard_after_forward=false", gpu_mem_bytes=80 * GIB)
    root, layer, full = 49152 * 576 + 576, shape.layer_params(), 2 * shape.total_params()
    update = kept["update actor"]
    root_row = "actor gathered root: embedding, norm, LM head (FSDP all-gather, bf16)"
    assert update[root_row] + update["actor gathered layers: all 30 kept to the backward (reshard_after_forward=false, "
                                     "bf16)"] == full
    assert resharded["update actor"][root_row] == 2 * root
    assert resharded["update actor"]["actor gathered layer (FSDP all-gather, bf16)"] == 2 * layer
    # GPU: the next layer's all-gather overlaps this one's compute: two buffers
    assert update["actor all-gather buffers (FSDP, bf16)"] == 2 * 2 * layer
    assert sum(kept["update actor"].values()) - sum(resharded["update actor"].values()) == 29 * 2 * layer
    # the other phases hold the shards only (the update's backward resharded every unit)
    assert {p: sum(t.values()) for p, t in kept.items() if p != "update actor"} == \
        {p: sum(t.values()) for p, t in resharded.items() if p != "update actor"}
    # the reshard on GPU: one full tensor on the device (the bucket goes to host memory)
    on_device = resharded["reshard"]["reshard bucket on the device: one full tensor (FSDP all-gather, bf16)"]
    assert on_device == 2 * 49152 * 576
    # a reference (KL in the reward) keeps nothing gathered between phases: the engine reshards every unit
    # after a no-grad forward (FSDP2 itself reshards in the backward only)
    with_ref = _smollm2_phases(*gpu, "actor.fsdp.reshard_after_forward=false", "algorithm.use_kl_in_reward=true",
                               gpu_mem_bytes=80 * GIB)
    assert not any("kept after" in label for terms in with_ref.values() for label in terms)


def test_fsdp_counts_the_attention_mask_where_the_attention_takes_one() -> None:
    """sdpa (the default on CPU) gets the block-diagonal mask of a packed row ([1, 1, T, T] bool: T squared
    bytes, T = actor.micro_batch_tokens 512 here), or of micro_batch_size padded rows; eager the same in
    the compute dtype; flash attention takes none (position_ids), nor does the GPU default where
    flash_attn is installed, while a GPU run that loads sdpa holds the mask on the device."""
    import importlib.util

    label = "attention mask of the packed rows (block-diagonal, T x T)"
    packed = _smollm2_phases("actor.engine=fsdp")
    assert packed["update actor"][label] == 512 ** 2
    flex = _smollm2_phases("actor.engine=fsdp", "actor.fsdp.attn_implementation=flex_attention")
    assert label not in flex["update actor"]
    assert sum(packed["update actor"].values()) - sum(flex["update actor"].values()) == 512 ** 2
    padded = _smollm2_phases("actor.engine=fsdp", "actor.packing=false", "actor.micro_batch_size=3")
    seq = 256 + 64  # the recipe's max_prompt_length + max_new_tokens
    assert padded["update actor"][label] == 3 * seq ** 2
    eager = _smollm2_phases("actor.engine=fsdp", "actor.fsdp.attn_implementation=eager")
    assert eager["update actor"][label] == 4 * 512 ** 2  # fp32 additive mask
    gpu = ("trainer.device=cuda", "model.dtype=bf16", "actor.engine=fsdp")
    flash = _smollm2_phases(*gpu, "actor.fsdp.attn_implementation=flash_attention_2", gpu_mem_bytes=80 * GIB)
    assert not any(label in terms for terms in flash.values())
    sdpa = _smollm2_phases(*gpu, "actor.fsdp.attn_implementation=sdpa", gpu_mem_bytes=80 * GIB)
    assert sdpa["update actor"][label] == 512 ** 2
    default = _smollm2_phases(*gpu, gpu_mem_bytes=80 * GIB)
    has_flash = importlib.util.find_spec("flash_attn") is not None
    assert any(label in terms for terms in default.values()) == (not has_flash)


def test_fsdp_cpu_offload_moves_the_shards_to_pinned_host_memory() -> None:
    cfg = load_config(REPO / SMOLLM2_RECIPE, ["trainer.device=cuda", "model.dtype=bf16", "actor.engine=fsdp",
                                              "actor.fsdp.cpu_offload=true"])
    validate(cfg)
    est = estimate(cfg, RoleShapes(policy=_smollm2_shape()), gpu_mem_bytes=80 * GIB)
    assert not any("FSDP shard" in label for p in est.phases for label in p.terms)
    assert {p.name: p.terms for p in est.phases}["optimizer step"].get("optimizer temporaries") is None  # on the host
    pinned = est.host_pinned_per_node["FSDP shards, gradients and Adam moments of the actor (actor.fsdp.cpu_offload)"]
    assert pinned == 2 * 16 * _smollm2_shape().total_params() // 2  # 2 workers x (4 + 4 + 8) bytes of half the model


def test_cli_fsdp_plan_prints_the_fsdp_rows(tmp_path) -> None:
    _smollm2_shape()
    # a run directory of its own: the recipe's may hold a demo's checkpoints, which another engine cannot resume
    r = hpcrl_cli("plan", SMOLLM2_RECIPE, "actor.engine=fsdp", f"trainer.run_dir={tmp_path}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "precision   FSDP (actor): fp32 weight shards over the 2 DP ranks, which are the masters" in r.stdout
    assert "micro-batches of up to 512 tokens (actor: laid out as for Megatron, packed or padded rows" in r.stdout
    for row in (f"actor weights ({FSDP_SHARD})", "actor gathered layer (FSDP all-gather, fp32)",
                "actor unsharded gradients before reduce-scatter", "reshard bucket: full tensors gathered"):
        assert row in r.stdout, row
    assert "masters and moments cut over" not in r.stdout and "master weights" not in r.stdout
    # the Megatron plan of the same recipe has none of it
    r = hpcrl_cli("plan", SMOLLM2_RECIPE, "actor.engine=megatron", f"trainer.run_dir={tmp_path}")
    assert r.returncode == 0 and "FSDP" not in r.stdout


def test_fsdp_start_up_holds_the_whole_fp32_model_in_host_memory_only() -> None:
    """The FSDP engine builds the model whole in fp32 in host memory and fully_shard moves it to the GPU
    unit by unit, cutting it: Llama-3-70B gets no start-up problem on an 80 GiB GPU, and a note gives
    the host memory each worker process needs while it builds."""
    flat = ("actor.parallel.tensor_parallel=1", "actor.parallel.pipeline_parallel=1",
            "actor.parallel.data_parallel=null", "critic.parallel.tensor_parallel=1",
            "critic.parallel.pipeline_parallel=1", "critic.parallel.data_parallel=null", "actor.recompute=full",
            "critic.recompute=full")
    shapes = RoleShapes(policy=read_model_shape(LLAMA3_70B))
    cfg = load_config(REPO / PPO_70B, ["actor.engine=fsdp", *flat])
    validate(cfg)
    est = estimate(cfg, shapes, gpu_mem_bytes=80 * GIB)
    assert not any("start-up" in p for p in est.problems), est.problems
    assert any(n.startswith("FSDP start-up: each worker process loads the whole model in fp32") and "host memory" in n
               for n in est.notes), est.notes


def test_fsdp_accumulate_unsharded_keeps_the_gathered_model_and_full_gradients_in_the_update() -> None:
    """actor.fsdp.accumulate_unsharded=true (CPU, fp32): the update holds every layer gathered and the
    whole model's fp32 gradients (summed over the micro-batches, reduce-scattered once), in place of one
    gathered layer and one layer's unsharded gradients; the other phases are unchanged."""
    shape = _smollm2_shape()
    base = _smollm2_phases("actor.engine=fsdp")
    acc = _smollm2_phases("actor.engine=fsdp", "actor.fsdp.accumulate_unsharded=true")
    update = acc["update actor"]
    layers = update["actor gathered layers: all 30 kept over the micro-batches (accumulate_unsharded, fp32)"]
    assert layers == 30 * shape.layer_params() * 4
    grads = update["actor unsharded gradients accumulated over the micro-batches (fp32)"]
    assert grads == 4 * shape.total_params()
    assert "actor gathered layer (FSDP all-gather, fp32)" in base["update actor"]
    assert "actor unsharded gradients before reduce-scatter" not in update
    others = [p for p in base if p != "update actor"]
    assert {p: acc[p] for p in others} == {p: base[p] for p in others}
