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

    path: str = MISSING  # the model's folder (config.json, *.safetensors, tokenizer files)
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
    """Training layout of one Megatron role. DP is what is left: workers / (TP * PP * CP)."""

    tensor_parallel: int = 1  # TP: each layer's weights split over this many ranks
    pipeline_parallel: int = 1  # PP: the layers split into this many stages
    # CP: each sequence split over this many ranks, in 2 x CP equal chunks (rank r keeps chunks r and
    # 2 x CP - 1 - r, so that every rank gets an early and a late chunk of causal attention's work);
    # the attention gathers keys and values over the CP ranks, every other layer works on the rank's
    # tokens alone, so activations per rank shrink by CP. Sequences are padded to a multiple of 2 x CP.
    context_parallel: int = 1
    # SP (Megatron's sequence parallel, needs TP > 1): the norm and dropout regions between the TP
    # layers are split over the sequence across the TP ranks (all-gather before, reduce-scatter after
    # each TP layer instead of an all-reduce), so their activations shrink by TP. Same results.
    sequence_parallel: bool = False
    # EP (MoE models): each MoE layer's experts are split over this many ranks, carved out of the role's
    # DP x CP ranks (the experts' own TP is the layers' TP, megatron's default), so it must divide DP x CP
    # and the model's number of experts. Dense layers and the attention are not affected.
    expert_parallel: int = 1
    # Optional: when set it must equal workers / (TP * PP * CP); a cross-check for cluster recipes.
    data_parallel: int | None = None


@dataclass
class OptimConfig:
    """AdamW of a trained role, with a learning-rate schedule over the run's optimizer steps."""

    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # where cosine and linear end, at the run's last optimizer step
    lr_schedule: str = "constant"  # after warmup: constant | cosine | linear (down to min_lr)
    warmup_steps: int = 0  # optimizer steps of linear warmup from lr / warmup_steps to lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # decay of Adam's first moment
    adam_beta2: float = 0.999  # decay of Adam's second moment
    adam_eps: float = 1e-8  # added to Adam's denominator
    clip_grad: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    # each DP rank keeps AdamW's moments (and bf16's fp32 masters) of its share of the parameters only,
    # steps it and sends the result to the others (ZeRO-1); the updates are bit-identical either way
    shard_over_dp: bool = True


@dataclass
class LoraConfig:
    """Low-rank adapters on the actor's linear layers (hpcrl/engines/megatron/lora.py). The base
    weights are frozen, the optimizer holds the adapters only, vLLM gets the merged weights, the
    reference policy is the base model without adapters (no second copy), and checkpoints hold the
    adapters plus the base model's path."""

    rank: int = 0  # r of each adapter; 0: no LoRA (full fine-tuning)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    # dropout on the adapter's input, in training; algorithm.name=dpo only (the RL loop refuses it:
    # its old log-probs come from forwards without dropout, so the PPO ratio would not be 1 on-policy)
    dropout: float = 0.0
    # megatron layers (linear_qkv, linear_proj, linear_fc1, linear_fc2), HF names (q_proj, k_proj and
    # v_proj together, o_proj, gate_proj and up_proj together, down_proj), or all-linear
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) to start from; its q/k/v
    # (and gate/up) adapters must share lora_A, as `hpcrl ckpt export-hf --lora` writes them.
    adapters: str | None = None


@dataclass
class MoeConfig:
    """The routers of a Mixture-of-Experts model (Qwen3-MoE) in training; the model's config.json has its
    experts (num_experts, num_experts_per_tok). Dense models refuse non-zero coefficients."""

    # Weight of each MoE layer's load-balancing loss on its router (Switch-Transformer style, megatron's
    # moe_aux_loss_coeff); 0: none.
    aux_loss_coeff: float = 0.0
    # Weight of the router z-loss, the squared log-sum-exp of the router logits (megatron's
    # moe_z_loss_coeff); 0: none.
    z_loss_coeff: float = 0.0


@dataclass
class FsdpConfig:
    """Options of the FSDP2 engine (`actor.engine=fsdp`, hpcrl/engines/fsdp): for every role it runs."""

    # GPU: parameters, gradients and optimizer state in host memory between uses (torch's
    # CPUOffloadPolicy); on CPU they are there already (no effect).
    cpu_offload: bool = False
    # Free each layer's gathered parameters after its forward (ZeRO-3); false keeps them to the backward
    # (ZeRO-2: more memory, one all-gather fewer per layer).
    reshard_after_forward: bool = True
    # Between the micro-batches of one optimizer step keep every layer's gathered parameters and the
    # unsharded gradients (one all-gather and one reduce-scatter per step instead of per micro-batch):
    # DDP's communication for a full copy of the model and of its gradients per worker.
    accumulate_unsharded: bool = False
    # transformers' attention implementation, passed to from_pretrained (eager, sdpa, flash_attention_2,
    # flash_attention_3, flex_attention, or a hub kernel "org/repo"). null: flash_attention_2 on CUDA
    # when the flash_attn package is installed (varlen attention over packed rows), else transformers'
    # default (sdpa). sdpa and eager attend under a block-diagonal mask that lets a prompt's samples
    # share it (actor.share_prompt); the others lay each sequence out whole.
    attn_implementation: str | None = None


@dataclass
class ActorConfig:
    """Policy trainer (Megatron-core, or FSDP2 over the HF model) and its PPO-family update."""

    # megatron: Megatron-core (TP x PP x CP x EP x DP; Llama/Qwen2/Qwen3/Qwen3-MoE families) | fsdp:
    # FSDP2 over the transformers model (any causal LM transformers builds; data parallel only)
    engine: str = "megatron"
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)  # the FSDP engine's options
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Samples per optimizer step; a step's rollout batch is split into several mini-batches.
    ppo_mini_batch_size: int = 16
    ppo_epochs: int = 1  # passes over the step's samples
    # Mini-batches are cut from a seeded shuffle of the step's prompts, each prompt's samples kept
    # together (seed: trainer.seed and the step, so a resumed run cuts the same ones); false: in
    # rollout order (prompt by prompt).
    shuffle_minibatches: bool = True
    # What the actor's shuffle deals out: "prompt" (each prompt's samples in one mini-batch and on
    # one rank, where the prompt is packed once) or "sample" (every sample on its own, as TRL's
    # GRPOTrainer shuffles them; inside a mini-batch a prompt's samples still go to one rank)
    minibatch_by: str = "prompt"
    # Where the PPO ratio's old log-probs come from. auto: a separate actor forward, except when
    # the update is on-policy (one mini-batch, one epoch, no KL in the reward), where the update's
    # own detached log-probs are used (ratio 1: the same update, one forward less); recompute:
    # always the separate forward; rollout: vLLM's processed log-probs (no forward). Without the
    # separate forward the rollout-vs-actor gap is measured in the update's first forward (the
    # first mini-batch's response tokens, before any optimizer step).
    old_logprob: str = "auto"
    # Token budget of one packed micro-batch (sequence packing, no padding). With context parallel
    # each sequence is padded to a multiple of 2 x CP and a row to a multiple of 2 x CP (x TP with
    # sequence parallel): the budget must be a multiple of that too.
    micro_batch_tokens: int = 4096
    # false: the padded baseline, micro_batch_size whole sequences per micro-batch
    packing: bool = True
    micro_batch_size: int = 4  # sequences per micro-batch without packing
    # Pack the samples of one prompt with that prompt once (it carries no loss): each sample's
    # answer attends to the shared copy. Same log-probs and update, ~40% fewer tokens at n=4 on the
    # demo. CPU (local layer spec) only; Transformer Engine's packed attention cannot express it.
    share_prompt: bool = True
    clip_ratio_low: float = 0.2  # PPO clips the ratio below 1 - clip_ratio_low
    # and above 1 + clip_ratio_high (DAPO's clip-higher: a larger value, which policy_loss=clip_higher requires)
    clip_ratio_high: float = 0.2
    # Dual-clip lower bound for negative advantages (Ye et al. 2020); must be > 1.
    clip_ratio_c: float = 3.0
    # How token losses make the mini-batch's loss: token-mean (over all its response tokens) |
    # seq-mean-token-sum (each sequence's sum, averaged over sequences) | seq-mean-token-mean
    loss_agg_mode: str = "token-mean"
    # Weight of the entropy bonus in the actor's loss (the entropy is logged as actor/entropy either way).
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False  # a KL-to-reference term in the actor's loss (GRPO's), instead of in the reward
    kl_loss_coef: float = 0.001  # its weight
    kl_loss_type: str = "k3"  # the KL estimator of that term (Schulman's k1 | k2 | k3)
    # GPU only: move params/grads/optimizer state to host memory while vLLM generates.
    offload: bool = False
    # Activation recompute in the update's backward (Megatron's recompute settings), trading compute
    # for memory: none (keep every activation the backward needs) | selective (recompute the core
    # attention, softmax(QK^T)V, from q, k and v: drops what the attention kernel keeps besides them,
    # the [heads, T, T] probabilities of dense attention, the softmax statistics of flash attention) |
    # full (keep only each layer's input and recompute the whole layer in the backward, one layer per
    # checkpoint: recompute_granularity=full, method uniform; about one more forward per update).
    recompute: str = "none"
    lora: LoraConfig = field(default_factory=LoraConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)  # the routers' auxiliary losses (MoE models only)


@dataclass
class CriticConfig:
    """Value model for GAE. `enable: null` means: on exactly when the estimator needs it (gae)."""

    enable: bool | None = None  # true | false | null (on for adv_estimator gae)
    engine: str | None = None  # megatron | fsdp; null: the actor's
    # Defaults to model.path (value head initialised fresh).
    model_path: str | None = None
    # Defaults to the actor's layout: the critic is colocated with the actor.
    parallel: ParallelConfig | None = None
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 16  # as actor.ppo_mini_batch_size
    ppo_epochs: int = 1  # as actor.ppo_epochs
    shuffle_minibatches: bool = True  # as actor.shuffle_minibatches
    micro_batch_tokens: int = 4096  # as actor.micro_batch_tokens
    packing: bool = True  # as actor.packing
    micro_batch_size: int = 4  # as actor.micro_batch_size
    recompute: str = "none"  # as actor.recompute
    # New values stay within this distance of the old ones in the clipped value loss (PPO2).
    cliprange_value: float = 0.5
    moe: MoeConfig = field(default_factory=MoeConfig)  # as actor.moe, of the critic's model


@dataclass
class ReferenceConfig:
    """Frozen reference policy for the KL term. `enable: null`: on when a KL term is used."""

    enable: bool | None = None  # true | false | null (on when a KL term is used)
    engine: str | None = None  # megatron | fsdp; null: the actor's
    # Defaults to the actor's layout: the reference is colocated with the actor.
    parallel: ParallelConfig | None = None


@dataclass
class MultiTurnConfig:
    """Multi-turn rollout with tools (hpcrl/agents/rollout.py, docs/agents.md): each sample is a
    conversation in which the model's tool calls are run and their answers appended, until an answer,
    max_turns or the token budget. The trainer gets the same batch, with the tool tokens out of the
    loss mask."""

    enable: bool = False  # multi-turn rollout with tools on or off
    # Model turns per sample (the first answer to the prompt counts).
    max_turns: int = 4
    # Tokens per sample after the prompt, model and tool tokens together (rollout.max_new_tokens
    # bounds each model turn). vLLM's max_model_len is data.max_prompt_length + this.
    max_total_tokens: int = 1024
    # Each: a built-in name (calculator, python) or {class: "package.module:Class" | built-in, kwargs: {...}}.
    tools: list[Any] = field(default_factory=list)
    # How calls are written and parsed: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>,
    # Qwen2.5 / Hermes), or {class: "package.module:Class", kwargs: {...}} (a hpcrl.agents.formats.ToolCallFormat).
    format: Any = "hermes"
    # The tools' schemas go to the chat template (`tools=`) when the prompts are built; templates that
    # render them (Qwen2.5's) describe the tools to the model themselves.
    tools_in_prompt: bool = True
    # A system message for every prompt (for templates that ignore `tools=`); "{tools}" in it becomes
    # the tools' JSON schemas, one a line. A prompt's own system message follows it in the same message.
    system_prompt: str | None = None
    # Calls past this many in one model turn are not run; each gets an error answer (counted).
    max_tool_calls_per_turn: int = 4
    # Bound on one tool call unless the tool sets its own timeout_s.
    tool_timeout_s: float = 30.0
    # A tool's answer longer than this many characters is cut in the middle.
    max_tool_result_chars: int = 4000


@dataclass
class RolloutConfig:
    """vLLM rollout engines: colocated with the trainer, or on their own workers (trainer.placement).
    Rollout DP = the workers that run engines / rollout TP."""

    tensor_parallel: int = 1  # TP of each vLLM engine (independent of the trainer's layout)
    n: int = 4  # samples per prompt (the group of GRPO/RLOO)
    # Sampling temperature; the trainer's log-probs are those of softmax(logits / temperature).
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much probability
    top_k: int = -1  # sample among the k likeliest tokens (-1: all)
    max_new_tokens: int = 256  # longest response, in tokens
    # Shortest response, in tokens: the model's EOS and the stop strings do not end a response before
    # it (vLLM's min_tokens); 0: none. For runs that need samples of a known length from a model that
    # would stop early (configs/grpo_long_tiny.yaml); at most max_new_tokens.
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # strings that end a response
    # Device memory for weights + KV cache on GPU; KV-cache GiB per worker on CPU (fractions allowed;
    # null: sized to hold a step's samples, or a validation batch, of one replica at full length).
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float | None = None  # see gpu_memory_utilization
    # Size of one weight bucket pushed from the trainer layout into vLLM.
    weight_bucket_mb: int = 256
    # How many training steps generation may run ahead of the trainer (trainer.placement=split only):
    # 0 generates a step's batch and then trains on it; 1 is one-step-off (batch k+1 is generated with
    # the weights before step k while the trainer updates on batch k); k > 1 keeps k batches ahead.
    # null: 1 with split placement, 0 colocated (where trainer and engines take turns on the devices).
    # Nothing is generated for a step past trainer.total_steps. A run resumed with a smaller value than
    # its checkpoint's batches were generated with regenerates those that would be staler (logged).
    max_staleness: int | None = None
    # How generation and training overlap: sync (a step generates its batch, then trains on it) |
    # one_step_off (split placement: rollout.max_staleness batches generated ahead, hpcrl.trainer.ahead)
    # | fully_async (split placement: the engines generate without waiting for steps, in segments of
    # rollout.segment_tokens; the trainer takes a batch of finished groups as soon as there are
    # enough, and rollout.max_staleness bounds how many weight versions behind the trainer any token of
    # a trained sample may be: hpcrl.trainer.stream). null: one_step_off with the split placement (sync
    # with max_staleness 0), sync colocated.
    mode: str | None = None
    # fully_async: at each weight update the samples being generated keep their tokens so far (each
    # token's log-prob and policy version recorded) and go on from them with the new weights (true); or
    # start again from their prompts (false, the tokens are thrown away). null: true.
    partial_rollout: bool | None = None
    # fully_async: the most tokens a sample gets per engine call; new weights load between calls, so
    # this bounds how long an update waits for the engines (and how finely a sample's tokens can span
    # versions)
    segment_tokens: int = 32
    # fully_async: a rollout pool worker (hpcrl.pools, `hpcrl submit --join`) that sends nothing for this
    # many seconds (it sends a heartbeat every quarter of it), or has not loaded new weights within it,
    # counts as gone: its share of the segment in flight goes to the other engines
    pool_liveness_s: float = 60.0
    # MoE models (routing replay, "R3"): vLLM's engines record the experts every token was routed to,
    # and the actor's forwards (old log-probs and the update) use those experts instead of routing
    # again, so both sides compute each token with the same experts.
    routing_replay: bool = False
    # Passed through to vllm.LLM(...) as they are (e.g. enforce_eager, max_num_seqs).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class KLControlConfig:
    """The coefficient of the KL in the reward: fixed, or adapted towards target_kl (Ziegler et al. 2019)."""

    type: str = "fixed"  # fixed | adaptive (towards target_kl)
    kl_coef: float = 0.001  # the coefficient (adaptive: its start)
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class DPOConfig:
    """Direct preference optimisation (algorithm.name=dpo): hpcrl/algos/dpo.py has the formulas."""

    # Weight of the implicit KL to the reference: the implicit rewards are beta * (log pi - log ref).
    beta: float = 0.1
    # sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023; each response's log-ratio averaged
    # over its tokens, as TRL's DPOTrainer computes it)
    loss_type: str = "sigmoid"
    # Conservative DPO (sigmoid only): the share of preference labels taken to be flipped, in [0, 0.5).
    label_smoothing: float = 0.0


@dataclass
class AlgorithmConfig:
    """Which loop trains, and for the PPO family: advantage estimator, policy loss and KL handling."""

    # ppo: the RL loop of hpcrl/trainer/ppo.py (PPO, GRPO, RLOO, REINFORCE++, ReMax, DAPO: picked by
    # adv_estimator and policy_loss); dpo: offline preference optimisation, hpcrl/trainer/dpo.py
    # (algorithm.dpo; reads preference pairs, no rollout, reward or critic).
    name: str = "ppo"
    # How advantages are estimated: gae (PPO, with a critic) | grpo | rloo | reinforce_plus_plus |
    # reinforce_plus_plus_baseline | remax
    adv_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"  # the actor's loss: ppo_clip | dual_clip | clip_higher (DAPO)
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE's lambda
    norm_adv_by_std: bool = True  # GRPO: divide by the group's reward std (false: Dr. GRPO's mean-centring only)
    # subtract kl_coef * KL(actor || reference) from the token rewards; every estimator sees it (the
    # group estimators compare the samples' summed token rewards, as verl does)
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"  # the KL estimator in the reward: k1 | k2 | k3
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # DAPO: drop groups whose rewards all agree and refill the batch, at most this many extra rounds.
    dynamic_sampling: bool = False
    max_refill_rounds: int = 4  # see dynamic_sampling
    # DAPO soft overlong penalty: the last `overlong_buffer` tokens before the limit are penalised.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the penalty at the limit (a linear ramp from 0 over the buffer)
    # Correction for samples drawn by another policy than the trainer's old one (the rollout of
    # one-step-off training ran weights a step older; bf16 kernels differ): the decoupled PPO objective,
    # the clipped ratio against the old log-probs recomputed by the trainer (the proximal policy), each
    # token's term weighted by w of ratio = exp(old - rollout): none | tis (truncated importance
    # sampling, w = min(ratio, cap); Yao et al. 2025, "Your efficient RL framework secretly brings you
    # off-policy RL training") | mis (masked: w = ratio up to the cap, 0 above it; AReaL).
    rollout_correction: str = "none"
    rollout_is_cap: float = 2.0  # tis, mis: the cap of the per-token weight
    dpo: DPOConfig = field(default_factory=DPOConfig)


@dataclass
class RewardConfig:
    """`function: builtin` picks the rule-based scorer by data_source (math answers, format)."""

    function: str = "builtin"  # or "package.module:function"
    # Bound on scoring one completion: past it the sample scores 0 (reward/timeouts) and the scoring
    # process is killed.
    timeout_s: float = 10.0
    format_weight: float = 0.0  # builtin: score = acc + format_weight * (answer in the expected format)
    # Optional reward model (a local HF folder); its score is added to the rule-based one.
    model_path: str | None = None


@dataclass
class DataConfig:
    """Prompts in the verl schema (prompt as chat messages, data_source, reward_model.ground_truth), or
    for DPO preference pairs in TRL's schema (prompt, chosen, rejected)."""

    train_files: list[str] = field(default_factory=list)  # .parquet or .jsonl files
    val_files: list[str] = field(default_factory=list)  # greedy validation every trainer.val_every steps
    prompt_key: str = "prompt"  # the column of the chat messages
    max_prompt_length: int = 512  # longer prompts (tokens, chat template applied) are dropped and counted
    train_batch_size: int = 8  # prompts per step (DPO: preference pairs per step, one optimizer step)
    val_batch_size: int = 64  # validation prompts per generate call
    val_max_samples: int = 0  # validate on the first N validation prompts; 0 = all
    # Rows that do not fit the schema (missing or mistyped fields, empty ground truth, lines that are
    # not UTF-8 JSON) are skipped and logged with their numbers while they are at most this share of
    # a file; above it the run is refused before it starts.
    max_skipped_row_share: float = 0.01
    # DPO (preference pairs in TRL's schema, hpcrl/data/preference.py): the fields of a row, and the
    # longest chosen / rejected response in tokens (EOS included); longer pairs are dropped and counted.
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"  # see chosen_key
    max_response_length: int = 512  # see chosen_key
    shuffle: bool = True  # a seeded shuffle of the training rows (false: file order)
    seed: int = 1  # of that shuffle


@dataclass
class TrainerConfig:
    """The run: its name and directory, how long, how many workers, on what."""

    project: str = "hpcrl"  # a group of runs (the run directory's parent, the W&B project)
    experiment: str = "default"  # this run's name
    # Where logs, metrics and checkpoints of this run go.
    run_dir: str = "runs/${trainer.project}/${trainer.experiment}"
    total_steps: int = 100  # training steps (rollout + update); a resumed run goes on to this many
    val_every: int = 0  # 0: no validation
    seed: int = 1  # sampling seeds, mini-batch shuffles, megatron's initialisation
    # Workers = nnodes * workers_per_node (one per GPU, or one per CPU slot); the controller is extra.
    nnodes: int = 1
    workers_per_node: int = 4  # see nnodes
    # colocated: every worker holds a trainer shard and a vLLM engine, which take turns on its device.
    # split: the last `rollout_workers` workers run only vLLM engines and the others only the trainer
    # roles; after each update the weights travel from the trainer's ranks to the engines
    # (hpcrl/workers/split.py), and generation can overlap training (rollout.max_staleness).
    placement: str = "colocated"
    rollout_workers: int = 0  # split only: how many of the workers run the rollout engines
    device: str = "auto"  # where the workers compute: auto (CUDA when there is a GPU) | cpu | cuda
    # Bound on every receive/collective: a hung or dead rank fails the run instead of hanging it.
    timeout_s: int = 600
    # An optimizer step whose loss or gradient is NaN/Inf is skipped (weights and optimizer state
    # unchanged, counted in actor|critic/nonfinite_steps_skipped); after this many in a row the run
    # stops without saving, so the last checkpoint stays the last good state. 0: never stop. The count
    # is saved with each checkpoint, so it goes on across a resume.
    max_nonfinite_steps: int = 3


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (docs/checkpoint.md): when to save, what to keep, where to resume from."""

    dir: str = "${trainer.run_dir}/checkpoints"  # step_NNNNNNNN/ folders and the `latest` pointer
    save_every: int = 0  # steps; 0 = only on preemption and at the end
    keep_last: int = 2  # the newest checkpoints kept; older ones are removed after a save
    keep_every: int = 0  # also keep every M-th step forever; 0 = none
    async_save: bool = False  # workers write in the background while the next step runs
    # auto: from the latest valid checkpoint in `dir`, if any | never | a checkpoint folder
    resume: str = "auto"
    # A save the storage refuses (disk full, quota; see docs/reliability.md) is removed and the
    # previous checkpoint stays the one a resume uses. stop: the run ends, exit status 4.
    # continue: a warning, and training goes on until the next save (the final save, and the one
    # before a preemption stop, still end the run with status 4: the run's state is not on disk).
    on_save_error: str = "stop"


@dataclass
class SlurmConfig:
    """The hetjob of `hpcrl submit` (docs/slurm.md): group 0 the controller, group 1 the workers."""

    partition: str | None = None  # --partition of both groups (null: the cluster's default)
    account: str | None = None  # --account
    qos: str | None = None  # --qos
    time: str = "04:00:00"  # --time: MM, HH:MM:SS or D-HH:MM:SS
    gpus_per_node: int = 0  # 0: CPU workers
    cpus_per_worker: int = 1  # --cpus-per-task of every task (and OMP_NUM_THREADS)
    mem_per_node: str | None = None  # --mem, e.g. 64G ("0": all of a node's memory)
    constraint: str | None = None  # --constraint of the worker nodes
    # Slurm may requeue the job after preemption or a node failure; the controller also requeues
    # itself before the time limit (signal_before_s).
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
class WandbConfig:
    """Weights & Biases (optional: `pip install wandb`). The API key comes from WANDB_API_KEY in the
    environment, which wandb reads itself: it is never part of the config, so it is never written to
    the run directory, a checkpoint's config.yaml or a job script."""

    # disabled | offline (a run folder under DIR/wandb/ to upload later with `wandb sync`) | online
    # (streamed to the W&B server; needs WANDB_API_KEY).
    mode: str = "disabled"
    project: str = "${trainer.project}"  # the W&B project
    # W&B team or user; null: the default entity of the API key.
    entity: str | None = None
    # wandb writes its run folders into DIR/wandb/.
    dir: str = "${trainer.run_dir}"
    # The W&B run's display name; its id comes from the run directory, so restarts continue one W&B run.
    name: str = "${trainer.experiment}"


@dataclass
class LoggingConfig:
    """Where the run's logs and metrics go, and what the terminal shows (docs/guide.md)."""

    # controller.log and each rank's full output, rank{R}.{host}.log.
    dir: str = "${trainer.run_dir}/logs"
    level: str = "INFO"  # of the controller's log (controller.log, and hpcrl's lines on the terminal)
    # false: the terminal (or Slurm's job log) shows hpcrl's lines and every rank's errors, the
    # libraries' output of every rank goes to its file in `dir` only; true: everything on the terminal
    # too (`hpcrl run --verbose`, `hpcrl submit --verbose`).
    verbose: bool = False
    log_every: int = 1  # a step line every N steps (and the last); metrics.jsonl gets every step
    # A phase of a step (rollout, validation, update, checkpoint save) that has run this long gets a
    # line with its rate and ETA, then one every progress_every_s (0: no such lines).
    progress_after_s: float = 30.0
    progress_every_s: float = 30.0  # see progress_after_s
    tensorboard: bool = True  # TensorBoard event files in {trainer.run_dir}/tensorboard
    wandb: WandbConfig = field(default_factory=WandbConfig)


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
