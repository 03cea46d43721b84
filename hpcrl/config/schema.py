"""Structured configs: one small dataclass per component, composed into `HpcrlConfig`.

OmegaConf turns these into typed configs, so a YAML recipe or a `key=value` override with an
unknown key or a value of the wrong type is refused before anything launches. Cross-field rules
(layout arithmetic, paths, enum values) live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """The policy model: a local HuggingFace folder (config.json + safetensors + tokenizer)."""

    path: str = MISSING
    # fp32 | bf16 | auto (auto: bf16 on GPU, fp32 on CPU, where bf16 log-probs drift by up to 0.19 nats)
    dtype: str = "auto"
    # Tokenizer folder when it is not beside the weights.
    tokenizer_path: str | None = None
    # Attention of megatron's local layer spec (CPU; GPUs use Transformer Engine's): per_sequence
    # (each packed sequence attends to itself, cost ~ sum of squared lengths) or dense (megatron's
    # DotProductAttention with a block-diagonal mask, cost ~ squared micro-batch length).
    local_attention: str = "per_sequence"


@dataclass
class ParallelConfig:
    """Training layout of one Megatron role. DP is what is left: workers / (TP * PP)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Optional: when set it must equal workers / (TP * PP); a cross-check for cluster recipes.
    data_parallel: int | None = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class ActorConfig:
    """Policy trainer (Megatron-core) and its PPO-family update."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Samples per optimizer step; a step's rollout batch is split into several mini-batches.
    ppo_mini_batch_size: int = 16
    ppo_epochs: int = 1
    # Mini-batches are cut from a seeded shuffle of the step's prompts, each prompt's samples kept
    # together (seed: trainer.seed and the step, so a resumed run cuts the same ones); false: in
    # rollout order (prompt by prompt).
    shuffle_minibatches: bool = True
    # Where the PPO ratio's old log-probs come from. auto: a separate actor forward, except when
    # the update is on-policy (one mini-batch, one epoch, no KL in the reward), where the update's
    # own detached log-probs are used (ratio 1: the same update, one forward less); recompute:
    # always the separate forward; rollout: vLLM's processed log-probs (no forward). Without the
    # separate forward the rollout-vs-actor gap is measured in the update's first forward (the
    # first mini-batch's response tokens, before any optimizer step).
    old_logprob: str = "auto"
    # Token budget of one packed micro-batch (sequence packing, no padding).
    micro_batch_tokens: int = 4096
    # false: the padded baseline, micro_batch_size whole sequences per micro-batch
    packing: bool = True
    micro_batch_size: int = 4
    # Pack the samples of one prompt with that prompt once (it carries no loss): each sample's
    # answer attends to the shared copy. Same log-probs and update, ~40% fewer tokens at n=4 on the
    # demo. CPU (local layer spec) only; Transformer Engine's packed attention cannot express it.
    share_prompt: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # Dual-clip lower bound for negative advantages (Ye et al. 2020); must be > 1.
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"  # k1 | k2 | k3
    # GPU only: move params/grads/optimizer state to host memory while vLLM generates.
    offload: bool = False


@dataclass
class CriticConfig:
    """Value model for GAE. `enable: null` means: on exactly when the estimator needs it (gae)."""

    enable: bool | None = None
    # Defaults to model.path (value head initialised fresh).
    model_path: str | None = None
    # Defaults to the actor's layout: the critic is colocated with the actor.
    parallel: ParallelConfig | None = None
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 16
    ppo_epochs: int = 1
    shuffle_minibatches: bool = True  # as actor.shuffle_minibatches
    micro_batch_tokens: int = 4096
    packing: bool = True
    micro_batch_size: int = 4
    cliprange_value: float = 0.5


@dataclass
class ReferenceConfig:
    """Frozen reference policy for the KL term. `enable: null`: on when a KL term is used."""

    enable: bool | None = None
    # Defaults to the actor's layout: the reference is colocated with the actor.
    parallel: ParallelConfig | None = None


@dataclass
class RolloutConfig:
    """vLLM rollout engine, colocated with the trainer. Rollout DP = workers / rollout TP."""

    tensor_parallel: int = 1
    n: int = 4  # samples per prompt (the group of GRPO/RLOO)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    # Device memory for weights + KV cache on GPU; KV-cache GiB per worker on CPU (fractions allowed;
    # null: sized to hold a step's samples, or a validation batch, of one replica at full length).
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float | None = None
    # Size of one weight bucket pushed from the trainer layout into vLLM.
    weight_bucket_mb: int = 256
    # Passed through to vllm.LLM(...) as they are (e.g. enforce_eager, max_num_seqs).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class DPOConfig:
    """Direct preference optimisation (algorithm.name=dpo): hpcrl/algos/dpo.py has the formulas."""

    # Weight of the implicit KL to the reference: the implicit rewards are beta * (log pi - log ref).
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023)
    # Conservative DPO (sigmoid only): the share of preference labels taken to be flipped, in [0, 0.5).
    label_smoothing: float = 0.0


@dataclass
class AlgorithmConfig:
    """Which loop trains, and for the PPO family: advantage estimator, policy loss and KL handling."""

    # ppo: the RL loop of hpcrl/trainer/ppo.py (PPO, GRPO, RLOO, REINFORCE++, ReMax, DAPO: picked by
    # adv_estimator and policy_loss); dpo: offline preference optimisation, hpcrl/trainer/dpo.py
    # (algorithm.dpo; reads preference pairs, no rollout, reward or critic).
    name: str = "ppo"
    adv_estimator: str = "grpo"  # gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax
    policy_loss: str = "ppo_clip"  # ppo_clip | dual_clip | clip_higher (DAPO)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"  # k1 | k2 | k3
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # DAPO: drop groups whose rewards all agree and refill the batch, at most this many extra rounds.
    dynamic_sampling: bool = False
    max_refill_rounds: int = 4
    # DAPO soft overlong penalty: the last `overlong_buffer` tokens before the limit are penalised.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dpo: DPOConfig = field(default_factory=DPOConfig)


@dataclass
class RewardConfig:
    """`function: builtin` picks the rule-based scorer by data_source (math answers, format)."""

    function: str = "builtin"  # or "package.module:function"
    timeout_s: float = 10.0
    format_weight: float = 0.0
    # Optional reward model (a local HF folder); its score is added to the rule-based one.
    model_path: str | None = None


@dataclass
class DataConfig:
    """Prompts in the verl schema (prompt as chat messages, data_source, reward_model.ground_truth), or
    for DPO preference pairs in TRL's schema (prompt, chosen, rejected)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    train_batch_size: int = 8  # prompts per step (DPO: preference pairs per step, one optimizer step)
    val_batch_size: int = 64
    val_max_samples: int = 0  # validate on the first N validation prompts; 0 = all
    # Rows that do not fit the schema (missing or mistyped fields, empty ground truth, lines that are
    # not UTF-8 JSON) are skipped and logged with their numbers while they are at most this share of
    # a file; above it the run is refused before it starts.
    max_skipped_row_share: float = 0.01
    # DPO (preference pairs in TRL's schema, hpcrl/data/preference.py): the fields of a row, and the
    # longest chosen / rejected response in tokens (EOS included); longer pairs are dropped and counted.
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_response_length: int = 512
    shuffle: bool = True
    seed: int = 1


@dataclass
class TrainerConfig:
    project: str = "hpcrl"
    experiment: str = "default"
    # Where logs, metrics and checkpoints of this run go.
    run_dir: str = "runs/${trainer.project}/${trainer.experiment}"
    total_steps: int = 100
    val_every: int = 0  # 0: no validation
    seed: int = 1
    # Workers = nnodes * workers_per_node (one per GPU, or one per CPU slot); the controller is extra.
    nnodes: int = 1
    workers_per_node: int = 4
    device: str = "auto"  # auto | cpu | cuda
    # Bound on every receive/collective: a hung or dead rank fails the run instead of hanging it.
    timeout_s: int = 600
    # An optimizer step whose loss or gradient is NaN/Inf is skipped (weights and optimizer state
    # unchanged, counted in actor|critic/nonfinite_steps_skipped); after this many in a row the run
    # stops without saving, so the last checkpoint stays the last good state. 0: never stop.
    max_nonfinite_steps: int = 3


@dataclass
class CheckpointConfig:
    dir: str = "${trainer.run_dir}/checkpoints"
    save_every: int = 0  # steps; 0 = only on preemption and at the end
    keep_last: int = 2
    keep_every: int = 0  # also keep every M-th step forever; 0 = none
    async_save: bool = False
    resume: str = "auto"  # auto | never | a checkpoint folder
    # A save the storage refuses (disk full, quota; see docs/reliability.md) is removed and the
    # previous checkpoint stays the one a resume uses. stop: the run ends, exit status 4.
    # continue: a warning, and training goes on until the next save (the final save, and the one
    # before a preemption stop, still end the run with status 4: the run's state is not on disk).
    on_save_error: str = "stop"  # stop | continue


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    gpus_per_node: int = 0  # 0: CPU workers
    cpus_per_worker: int = 1
    mem_per_node: str | None = None
    constraint: str | None = None
    requeue: bool = True
    # Requeues of a job whose run failed (a rank killed, OOM, a crash) before it is left failed; each
    # restart resumes from the last checkpoint. 0: a failed run stays failed. Needs `requeue`.
    max_failure_requeues: int = 2
    # Seconds before the time limit at which Slurm sends USR1 (the save-and-requeue signal).
    signal_before_s: int = 300
    # Extra `#SBATCH` options, e.g. ["--exclusive", "--reservation=rl"].
    extra_sbatch: list[str] = field(default_factory=list)
    # srun's MPI plugin: pmi2 is what Debian's Slurm and the pip MPICH have in common.
    mpi: str = "pmi2"


@dataclass
class LoggingConfig:
    dir: str = "${trainer.run_dir}/logs"
    level: str = "INFO"
    log_every: int = 1
    tensorboard: bool = True
    wandb: bool = False


@dataclass
class HpcrlConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
