"""End to end: `hpcrl run` trains the tiny model with GRPO (TP=1 x DP=2 on 2 workers) and with PPO (critic +
GAE, TP=2 on 2 workers).

The tiny random model cannot do arithmetic, so these runs score the share of digits in the output
(`hpcrl.rewards.toy:digit_fraction`, a custom reward loaded by `module:function`): a graded reward it
can learn in a few steps. Learning shows as a higher mean reward in the last steps than in the first.
The GRPO run is the session fixture `grpo_reference` (conftest.py), shared with tests/test_resume.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import HPCRL, REPO, TRAIN_STEPS, hf_token_logprobs, hpcrl_cli, hpcrl_run, read_jsonl, run

# W&B offline gets a key in its environment it must never write anywhere (hpcrl.trainer.wandb_sink)
FAKE_WANDB_KEY = "hpcrl-test-fake-wandb-key-8f3a91c2d7e4b605"


@pytest.fixture(scope="module")
def ppo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The PPO run, which also writes TensorBoard and an offline W&B run, with a W&B key in its environment.
    On 2 workers (TP=2, DP=1; 2 ranks fewer to start, ~22 CPU-s): PPO at DP=2 is the Slurm job of
    tests/test_submit.py (sbatch/ppo_70b.sh on 2 nodes x 2 workers)."""
    d = tmp_path_factory.mktemp("ppo") / "run"
    return d, hpcrl_run(d, "trainer.workers_per_node=2", "algorithm.adv_estimator=gae",
                        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                        "algorithm.kl_ctrl.kl_coef=0.01", "critic.optim.lr=1e-3",
                        "algorithm.dynamic_sampling=true", "checkpoint.save_every=3", "checkpoint.async_save=true",
                        "logging.tensorboard=true", "logging.wandb.mode=offline",
                        env={"WANDB_API_KEY": FAKE_WANDB_KEY})


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.world  # its fixture comes through request.getfixturevalue
@pytest.mark.parametrize("algo", ["grpo_reference", "ppo"])
def test_learns(algo: str, request: pytest.FixtureRequest) -> None:
    _, steps = request.getfixturevalue(algo)
    assert [m["step"] for m in steps] == list(range(1, TRAIN_STEPS + 1))
    rewards = [m["reward/mean"] for m in steps]
    first, last = mean(rewards[:5]), mean(rewards[-5:])
    # measured: 0.51 -> 0.68 (GRPO), 0.54 -> 0.71 (PPO); without learning it stays near 0.45
    assert last > first + 0.08, rewards


@pytest.mark.world  # its fixture comes through request.getfixturevalue
@pytest.mark.parametrize("algo", ["grpo_reference", "ppo"])
def test_step_record(algo: str, request: pytest.FixtureRequest) -> None:
    run_dir, steps = request.getfixturevalue(algo)
    m = steps[0]
    # 8 prompts x 4 samples, ppo_mini_batch_size 16: 2 optimizer steps per training step
    assert m["actor/optimizer_steps"] == 2
    # the rollout engine ran the actor's weights (resharded before every step): fp32 on both sides, measured
    # 9.5e-7 at most (GRPO and PPO, 2026-12-08); a weight a step stale moves it to ~1 (the one-step-off run)
    assert max(s["rollout_actor_logprob_gap_max"] for s in steps) < 1e-5
    assert 0 < m["response_length/mean"] <= 16
    assert m["throughput/tokens_per_s"] > 0 and m["reward/errors"] == 0
    # peak resident memory of the worker processes, per step (the tiny model: well under 5 GB)
    assert all(0.2 < s["memory/rss_gb_mean"] <= s["memory/rss_gb_max"] < 5 for s in steps), steps[-1]
    if algo == "ppo":
        assert "critic/vf_loss" in m and "actor/kl" in m and "actor/kl_coef" in m
        assert steps[-1]["critic/vf_loss"] < steps[0]["critic/vf_loss"]
        assert steps[-1]["actor/kl_coef"] != steps[0]["actor/kl_coef"]  # the adaptive controller moved
        # DAPO dynamic sampling: groups with a reward spread are kept (a graded reward: nearly all)
        assert all(s["dapo/groups_with_signal"] >= 1 for s in steps)
    # the end of the run is saved (PPO also saved every 3 steps in the background: 9 is kept), and the
    # log is where the run said
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == (["step_00000009", "step_00000010"] if algo == "ppo" else ["step_00000008", "step_00000010"])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{TRAIN_STEPS:08d}"
    if algo == "ppo":
        assert hpcrl_cli("ckpt", "verify", str(run_dir)).returncode == 0  # sha256 of every file
    assert (run_dir / "logs" / "controller.log").read_text().count(f"step {TRAIN_STEPS}/{TRAIN_STEPS} |") == 1


# The 70B recipe's numeric path on CPU: bf16 weights with fp32 masters, TP=2, sampling at T=0.7, with
# PP=1 and rollout TP=1 on 2 workers, and PP=2 and rollout TP=2 on 4 (bf16 with TP > 1 used to die in the
# first reshard: megatron's CPU norms stay fp32 inside a bf16 model, and a bucket was sent as one dtype).
# (pipeline parallel, rollout TP, workers)
BF16_LAYOUTS = {"tp2pp1-rollout1": ("1", "1", "2"), "tp2pp2-rollout2": ("2", "2", "4")}
BF16_GAP_FLOOR = 1e-4  # rollout-vs-actor mean gap: bf16 measures 1.6e-3, fp32 2e-7 (see below)


@pytest.fixture(scope="module", params=sorted(BF16_LAYOUTS))
def bf16_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    pp, rollout_tp, workers = BF16_LAYOUTS[request.param]
    d = tmp_path_factory.mktemp(f"bf16-{request.param}") / "run"
    return d, hpcrl_run(d, "model.dtype=bf16", "trainer.total_steps=2", f"trainer.workers_per_node={workers}",
                        f"actor.parallel.pipeline_parallel={pp}",
                        f"rollout.tensor_parallel={rollout_tp}", "rollout.temperature=0.7", "checkpoint.save_every=0")


def test_bf16_runs_complete_with_finite_changed_weights(bf16_run: tuple[Path, list[dict]]) -> None:
    import torch
    from conftest import TINY_MODEL
    from safetensors.torch import load_file

    run_dir, steps = bf16_run
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # bf16 on both sides (vLLM and Megatron, different kernels; megatron keeps its CPU norms in
        # fp32): measured mean gaps of 1.6e-3 to 1.8e-3 nats per step (max 1.1e-2). fp32 on both
        # sides gives 1.4e-7 to 2.1e-7 (the GRPO run): a gap above 1e-4 shows both ran in bf16
        assert BF16_GAP_FLOOR < m["rollout_actor_logprob_gap_mean"] < 0.01, m
        assert m["actor/grad_norm"] == m["actor/grad_norm"] and m["actor/grad_norm"] > 0  # finite, not 0
    out = run_dir / "export"
    r = hpcrl_cli("ckpt", "export-hf", str(run_dir), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    new = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    old = {k: v for f in TINY_MODEL.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(new) == sorted(old)
    # the workers trained in bf16: the checkpoint's weights (the model's own tensors) are bf16 but the
    # norms, which megatron keeps in fp32 on CPU; the model file is fp32
    assert {str(v.dtype) for v in old.values()} == {"torch.float32"}
    assert {k for k, v in new.items() if v.dtype != torch.bfloat16} <= {k for k in new if k.endswith("norm.weight")}
    numel = sum(v.numel() for v in new.values())
    bf16_share = sum(v.numel() for v in new.values() if v.dtype == torch.bfloat16) / numel
    assert bf16_share > 0.99, bf16_share
    assert all(torch.isfinite(v.float()).all() for v in new.values())
    changed = sum(int((new[k].float() != old[k].to(new[k].dtype).float()).sum()) for k in old)
    assert changed > 0.5 * sum(v.numel() for v in old.values())  # bf16 weights moved almost everywhere


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Multi-turn GRPO with a tool (configs/grpo_tools_tiny.yaml: the toy marker format, a counting
    tool that fails for some inputs and times out for others), 2 steps with validation."""
    d = tmp_path_factory.mktemp("tools") / "run"
    # 2 workers (the recipe has 4): half the engines to start, the same 32 conversations per step
    r = run([HPCRL, "run", "configs/grpo_tools_tiny.yaml", f"trainer.run_dir={d}", "trainer.total_steps=2",
             "trainer.workers_per_node=2", "logging.tensorboard=false"], timeout=900)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return d, read_jsonl(d / "metrics.jsonl")


def test_multi_turn_run_with_a_tool(tools_run: tuple[Path, list[dict]]) -> None:
    run_dir, steps = tools_run
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 1 <= m["multi_turn/turns_mean"] <= m["multi_turn/turns_max"] <= 3, m  # max_turns
        assert m["multi_turn/tokens_after_prompt_max"] <= 64  # the token budget
        assert m["multi_turn/tool_calls"] > 0 and 0 < m["multi_turn/tool_token_share"] < 1
        ends = [m[f"multi_turn/ended_{e}"] for e in ("answer", "max_turns", "budget", "turn_length")]
        assert sum(ends) == pytest.approx(1.0)
        # the gap on the model's tokens (tool tokens are outside the mask), fp32 on both sides: measured mean
        # 1.7e-7, max 9.5e-7 (2026-12-08)
        assert m["rollout_actor_logprob_gap_mean"] <= 2e-6 and m["rollout_actor_logprob_gap_max"] < 1e-5, m
        assert m["actor/optimizer_steps"] == 2 and m["actor/grad_norm"] > 0
        assert m["response_length/mean"] > 0 and m["reward/errors"] == 0
    # failing and hanging calls were answered with errors, counted, reported, and the run went on
    assert sum(m["multi_turn/tool_errors"] for m in steps) > 0
    assert sum(m["multi_turn/tool_errors_exception"] + m["multi_turn/tool_timeouts"] for m in steps) == \
        sum(m["multi_turn/tool_errors"] for m in steps)
    assert "val/reward_mean" in steps[0]  # validation ran through the loop too (greedy, no seeds)
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "multi-turn rollout: 32 samples" in log and "tool calls failed (" in log


@pytest.mark.world
def test_grpo_with_the_code_execution_reward(tmp_path: Path) -> None:
    """GRPO on the tiny coding tasks of `make data` (data/code: stdin/stdout test cases in the ground
    truth) scored by the sandbox reward, 2 steps end to end. The random model writes no ```python
    block, so its samples score 0, but every row's test cases were parsed in the reward workers (a
    malformed one counts in reward/errors); the reference programs of the same rows, scored through
    the same reward workers, pass every case, and a wrong one passes none."""
    import json

    from hpcrl.rewards import RewardInput, RewardScorer

    steps = hpcrl_run(tmp_path / "run", "data.train_files=[data/code/train.jsonl]", "data.val_files=[]",
                      "reward.function=hpcrl.sandbox.reward:fraction_passed", "reward.timeout_s=30",
                      "trainer.total_steps=2", "data.max_prompt_length=192", "trainer.workers_per_node=2")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0 and 0.0 <= m["reward/mean"] <= 1.0, m
        assert "reward_by_source/hpcrl/code/mean" in m and m["actor/optimizer_steps"] >= 1
    rows = read_jsonl(Path("data/code/train.jsonl"))[:6]  # one of each task
    wrong = "```python\nprint(0)\n```"
    items = [RewardInput(data_source=r["data_source"], response=f"```python\n{r['extra_info']['solution']}```",
                         ground_truth=r["reward_model"]["ground_truth"], extra_info={}) for r in rows]
    items.append(RewardInput(data_source="hpcrl/code", response=wrong,
                             ground_truth=json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}), extra_info={}))
    with RewardScorer("hpcrl.sandbox.reward:fraction_passed", timeout_s=30.0, workers=2) as scorer:
        assert scorer.score(items).scores == [1.0] * 6 + [0.0]


def test_plot_and_progress_lines(ppo: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """`hpcrl plot` draws the PPO run (rewards, lengths, KL, time per phase, memory) into PNGs; each
    step's log line carries an ETA until the last; a directory without steps is refused by name."""
    from matplotlib import image

    from hpcrl.trainer.metrics import duration, remaining_s

    run_dir, _ = ppo
    r = run([HPCRL, "plot", str(run_dir), "--out", str(tmp_path / "plots")])
    assert r.returncode == 0, r.stderr
    paths = [Path(p) for p in r.stdout.split()]
    assert [p.name for p in paths] == ["rewards.png", "lengths.png", "kl_entropy.png", "time.png", "memory.png"]
    for p in paths:
        pixels = image.imread(p)  # a PNG matplotlib reads back, 1000 x 450, not one flat colour
        assert pixels.shape[:2] == (450, 1000) and pixels.std() > 0.05, p
    lines = [ln for ln in (run_dir / "logs" / "controller.log").read_text().splitlines() if "step " in ln]
    steps = [ln for ln in lines if f"/{TRAIN_STEPS} |" in ln]
    assert len(steps) == TRAIN_STEPS and all(" | ETA " in ln for ln in steps[:-1]) and "ETA" not in steps[-1]
    # the pace is that of the steps after the first; 5 steps left at 12.5 s each
    assert remaining_s(0.0, [30.0, 40.0, 55.0], left=5) == 62.5 and remaining_s(10.0, [30.0], left=2) == 40.0
    assert [duration(s) for s in (4, 725, 11220, 187200)] == ["4 s", "12m05s", "3h07m", "2d04h"]
    empty = run([HPCRL, "plot", str(tmp_path)])
    assert empty.returncode == 1 and "metrics.jsonl: no step records" in empty.stderr, empty.stderr


# What every PPO step records (issue: metrics), by the names metrics.jsonl, TensorBoard and W&B use.
STEP_METRICS = [
    "reward/mean", "reward/std", "reward_by_source/hpcrl/arith/mean", "reward_by_source/hpcrl/arith/std",
    "response_length/mean", "response_length/max", "prompt_length/mean",
    "actor/kl", "actor/ppo_kl", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm", "actor/lr",
    "advantages/mean", "advantages/std", "advantages/min", "advantages/max",
    "rollout_actor_logprob_gap_mean", "rollout_actor_logprob_gap_max",
    "throughput/tokens_per_s", *(f"throughput/{phase}_tokens_per_s" for phase in
                                 ("generate", "old_logprob", "ref_logprob", "values", "update_critic", "update_actor")),
    *(f"time/{phase}" for phase in ("step", "reshard", "generate", "to_training", "old_logprob", "ref_logprob",
                                    "values", "update_critic", "update_actor")),
    # peak memory per rank: the controller (0) and the 2 workers, RSS on CPU
    *(f"memory/rank{r}/rss_gb" for r in range(3)), "memory/rss_gb_max", "memory/rss_gb_mean",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
]


def test_every_step_records_every_metric(ppo: tuple[Path, list[dict]]) -> None:
    _, steps = ppo
    for m in steps:
        missing = [k for k in STEP_METRICS if not isinstance(m.get(k), (int, float))]
        assert not missing, f"step {m['step']} lacks {missing}"
        assert m["actor/entropy"] > 0 and m["advantages/min"] <= m["advantages/mean"] <= m["advantages/max"]
        assert all(0.05 < m[f"memory/rank{r}/rss_gb"] < 5 for r in range(3)), m
        assert m["reward_by_source/hpcrl/arith/mean"] == pytest.approx(m["reward/mean"])  # the only data source


def test_tensorboard_reader_and_wandb_offline(ppo: tuple[Path, list[dict]]) -> None:
    """TensorBoard's own reader reads every step metric back; W&B offline wrote its run folder, and the
    W&B key of the environment is nowhere under the run directory, nor in what the terminal showed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, steps = ppo
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert not set(STEP_METRICS) - tags, sorted(set(STEP_METRICS) - tags)
    rewards = events.Scalars("reward/mean")
    assert [e.step for e in rewards] == [m["step"] for m in steps]
    assert [e.value for e in rewards] == pytest.approx([m["reward/mean"] for m in steps], rel=1e-6)

    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    assert list(offline.glob("*.wandb")) and (offline / "files").is_dir(), sorted(p.name for p in offline.iterdir())
    key = FAKE_WANDB_KEY.encode()
    leaked = [p for p in [*run_dir.rglob("*"), run_dir.parent / "terminal.stdout", run_dir.parent / "terminal.stderr"]
              if p.is_file() and key in p.read_bytes()]
    assert not leaked, leaked
    assert "wandb:\n    mode: offline" in (run_dir / "config.yaml").read_text()  # the saved config was searched too


def test_quiet_terminal_full_logs(ppo: tuple[Path, list[dict]]) -> None:
    """The terminal shows hpcrl's lines (one per step); each rank's library output is in its own file."""
    run_dir, _ = ppo
    out = (run_dir.parent / "terminal.stdout").read_text()
    err = (run_dir.parent / "terminal.stderr").read_text()
    step_lines = [ln for ln in out.splitlines() if f"/{TRAIN_STEPS} | reward " in ln]
    assert len(step_lines) == TRAIN_STEPS, out
    assert all(" | kl " in ln and " | tok/s " in ln for ln in step_lines)
    library_lines = [ln for ln in (out + err).splitlines()
                     if ln and " hpcrl" not in ln and not ln.startswith("hpcrl run:")]
    assert not library_lines, "\n".join(library_lines[:20])
    logs = run_dir / "logs"
    for rank in range(3):
        (log,) = logs.glob(f"rank{rank}.*.log")
        text = log.read_text(errors="replace")
        assert text.startswith("[hpcrl stderr] start pid=") and "[hpcrl stderr] exit pid=" in text, log
    # what the workers' libraries printed (vLLM's engine set-up, megatron, torch) is there, not on the terminal
    worker_text = "".join(p.read_text(errors="replace") for p in logs.glob("rank[1-2].*.log"))
    assert len(worker_text.splitlines()) > 2 * 3, worker_text[:3000]


def test_ranks_leave_together_after_a_clean_run(ppo: tuple[Path, list[dict]]) -> None:
    """After the run's last line the world ends within seconds: the ranks leave one after another
    (hpcrl.launch.exit_order), so each one's exit must be quick. Tearing down an interpreter with
    torch, megatron and vLLM loaded took ~4 s of garbage collection per rank (launchers/hpcrl_entry.py
    `_leave`)."""
    from hpcrl.controller.stderr_log import exit_time

    run_dir, _ = ppo
    exits = []
    for log in (run_dir / "logs").glob("rank*.log"):
        pid = int(log.read_text(errors="replace").split("pid=", 1)[1].split()[0])  # its "start pid=P" line
        at = exit_time(str(log), pid)
        assert at is not None, f"{log}: no exit line"
        exits.append(at)
    assert len(exits) == 3
    # measured alone on the ppo run: 11.6 s before, 2.6 s after
    assert max(exits) - min(exits) < 8.0, f"the ranks left over {max(exits) - min(exits):.1f} s: {sorted(exits)}"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """GRPO with LoRA adapters (actor.lora) and a KL loss to the frozen base, TP=2 x PP=2 on 4 workers
    with rollout TP=2 (so every reshard merges and re-splits the adapters across both layouts), on
    the tiny model with its embedding scaled x5. Why scaled: the tiny model's tied embedding (std
    0.02) caps how far any change of the final hidden state can move its logits (|e| |h| ~ 2.6
    after the final RMSNorm), and LoRA leaves the embedding frozen; full fine-tuning learns through
    the embedding itself. Measured over 10 steps: LoRA on the tiny model 0.49 -> 0.46 (no
    learning), on the scaled copy 0.48 -> 0.89. The KL loss uses k2: k3's exp(ref - logp) has an
    unbounded gradient where the policy leaves the base far behind, and after grad-norm clipping it
    crowded out the policy gradient (0.34 -> 0.47 with k3, 0.38 -> 0.84 with k2, coefficient 0.001)."""

    from conftest import TINY_MODEL
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("lora")
    model = root / "tiny-embed-x5"
    shutil.copytree(TINY_MODEL, model)
    for f in model.glob("*.safetensors"):
        t = load_file(str(f))
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"] * 5
        save_file(t, str(f), metadata={"format": "pt"})
    d = root / "run"
    return model, d, hpcrl_run(d, f"model.path={model}", "actor.parallel.pipeline_parallel=2",
                               "rollout.tensor_parallel=2", "actor.lora.rank=8",
                               "actor.lora.alpha=16", "actor.optim.lr=1e-2", "actor.use_kl_loss=true",
                               "actor.kl_loss_type=k2")


def test_grpo_with_lora_learns(lora_run: tuple[Path, Path, list[dict]]) -> None:
    _, run_dir, steps = lora_run
    rewards = [m["reward/mean"] for m in steps]
    assert len(rewards) == TRAIN_STEPS
    assert mean(rewards[-5:]) > mean(rewards[:5]) + 0.08, rewards  # the full-weight test's criterion
    # vLLM generated with the merged weights (W + scale B A, pushed by every reshard): fp32 log-probs
    # equal the actor's
    assert max(s["rollout_actor_logprob_gap_max"] for s in steps) < 1e-4
    # the reference is the actor's base with its adapters off: 0 KL before the first update, then not
    assert steps[0]["actor/kl_loss"] >= 0 and steps[-1]["actor/kl_loss"] > 1e-4
    # ... and no second model was built for it
    assert "actor, reference (the actor's base, adapters off)" in (run_dir / "logs" / "controller.log").read_text()


def test_lora_checkpoint_holds_the_adapters_and_exports_for_peft(lora_run: tuple[Path, Path, list[dict]],
                                                                 grpo_reference: tuple[Path, list[dict]],
                                                                 tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, run_dir, _ = lora_run
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    saved = {k for f in (latest / "actor").glob("*.safetensors") for k in load_file(str(f))}
    params = {k.split("::", 1)[1] for k in saved if k.startswith("param::")}
    assert params and all(".lora_" in k for k in params), sorted(params)[:4]  # adapters only, no base weights
    adapters, full = tmp_path / "adapters", tmp_path / "merged"
    for out, extra in ((adapters, ["--lora"]), (full, [])):
        r = hpcrl_cli("ckpt", "export-hf", str(run_dir), "--out", str(out), *extra)
        assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in adapters.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    # peft loads the adapters onto the base; merged, they are the merged export (the weights vLLM ran)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(base, str(adapters)).merge_and_unload().state_dict()
    exported = {k: v for f in full.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    original = {k: v for f in model.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(exported) == sorted(original)
    moved = [k for k in exported if not torch.equal(exported[k], original[k])]
    assert moved and all("proj" in k for k in moved)  # only adapted layers differ from the base
    assert max(float((exported[k] - peft_merged[k]).abs().max()) for k in exported) < 1e-6
    # a full-weight run's checkpoint has no adapters: --lora is refused with the reason, nothing written
    full_run, _ = grpo_reference
    r = hpcrl_cli("ckpt", "export-hf", str(full_run), "--out", str(tmp_path / "x"), "--lora")
    assert r.returncode == 2 and "no LoRA adapters" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x").exists()


def test_one_step_off_split_placement_learns(one_step_off: tuple[Path, list[dict]]) -> None:
    """GRPO with the engines on workers of their own, generating batch k+1 while the trainer
    updates on batch k: it learns as the synchronous run does, every batch after the first comes from
    the weights one step behind, and every rollout worker received the model once per step."""
    run_dir, steps = one_step_off
    rewards = [m["reward/mean"] for m in steps]
    assert [m["step"] for m in steps] == list(range(1, TRAIN_STEPS + 1))
    assert mean(rewards[-5:]) > mean(rewards[:5]) + 0.08, rewards  # the colocated test's criterion
    assert [m["rollout/staleness"] for m in steps] == [0.0] + [1.0] * (TRAIN_STEPS - 1)
    assert [m["rollout/policy_version"] for m in steps] == [0.0] + [float(s - 2) for s in range(2, TRAIN_STEPS + 1)]
    # the first batch is generated before training; the others while the previous step trained
    assert "time/generate" in steps[0] and not any("time/generate" in m for m in steps[1:])
    # each prompt of the epoch (2000 rows, 8 per step) exactly once, in the sampler's order
    rows = [r for m in steps for r in m["data/prompt_rows"]]
    assert len(rows) == len(set(rows)) == 8 * TRAIN_STEPS
    # truncated importance weights of the stale batches: ratios around 1, capped at 2
    assert all(0.5 < m["rollout_is/weight_mean"] < 1.5 and m["rollout_is/ratio_max"] > 1 for m in steps[1:])
    # the weights went to the engines after every step but the last (nothing generates after it)
    transfers = [m for m in steps if "weights/sent_mb" in m]
    assert transfers == steps[:-1] and all(m["time/transfer"] > 0 for m in transfers)
    # every rollout rank received the model's tensors once (rollout TP=1: exactly its engine's weights)
    assert all(m["weights/received_mb_max"] == m["weights/sent_mb"] > 1.0 for m in transfers)
    # each side's peak memory is recorded: 2 trainer ranks and 1 rollout rank, and the memory plan
    # of each kind of worker (hpcrl plan: a trainer worker without vLLM, a rollout worker with vLLM
    # alone) is near what each kind measured: measured / planned 1.00 and 1.06 in a run alone, 1.23
    # and 1.27 inside a whole CI run from a fresh clone (docs/planner.md)
    assert all(f"memory/rank{r}/rss_gb" in steps[-1] for r in range(1, 4))
    r = hpcrl_cli("plan", str(run_dir / "config.yaml"), "--compare", str(run_dir))
    ratios = [float(x) for x in re.findall(r"median measured / estimated over steps >= 2: ([0-9.]+)", r.stdout)]
    assert r.returncode == 0 and len(ratios) == 2 and all(0.9 <= x <= 1.4 for x in ratios), r.stdout + r.stderr
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "split placement" in log and "worker groups ready" in log


def test_one_step_off_batches_come_from_the_previous_weights(one_step_off: tuple[Path, list[dict]],
                                                             tmp_path: Path) -> None:
    """From outside the run's own counters: the batch that step 9's checkpoint holds for step 10
    (rollouts_ahead.pt) carries vLLM's log-probs; HF recomputes them with the weights of the
    checkpoints of steps 8 (the previous step's, which generated it) and 9 (the current ones).
    The fixture (conftest.py) saves every step and keeps the last 3 for this."""
    import torch
    from omegaconf import OmegaConf

    run_dir, _ = one_step_off
    ckpts = run_dir / "checkpoints"
    (ahead,) = torch.load(ckpts / "step_00000009" / "rollouts_ahead.pt", weights_only=True)
    assert (ahead["step"], ahead["version"]) == (10, 8), {k: ahead[k] for k in ("step", "version")}
    batch = ahead["tensors"]
    temperature = OmegaConf.load(run_dir / "config.yaml").rollout.temperature
    gaps = {}
    for step in (8, 9):
        out = tmp_path / f"step{step}"
        r = hpcrl_cli("ckpt", "export-hf", str(run_dir), "--step", str(step), "--out", str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        lp = hf_token_logprobs(out, batch, temperature)
        gaps[step] = (lp - batch["rollout_logprob"]).abs()[batch["response_mask"].bool()]
    # fp32 vLLM vs fp32 HF with the weights that sampled: float noise (measured max 9.5e-7, mean
    # 1.7e-7 over 512 tokens) ...
    assert gaps[8].max() <= 1e-5, float(gaps[8].max())
    # ... and one optimizer step later the log-probs differ far above it (measured mean 0.23, max 0.64)
    assert gaps[9].mean() > 100 * max(float(gaps[8].mean()), 1e-7), (float(gaps[9].mean()), float(gaps[8].mean()))


def test_fully_async_samples_span_versions_with_each_tokens_own_log_probs(
        grpo_reference: tuple[Path, list[dict]], fully_async_run: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """4 steps of rollout.mode=fully_async (conftest.fully_async_run). The per-token versions: samples span
    two versions, none is older than the bound, the prompts are the sampler's, each once (those of the
    synchronous run).
    The behaviour log-probs: the tokens made by the trainer's current weights match its recomputed
    log-probs, those of older weights do not (so the versions tell them apart); and from outside the
    run, every token the checkpoints' streams hold (samples in flight or waiting, saved each step)
    equals HF's log-prob under the checkpoint of the version recorded for it."""
    import torch
    from omegaconf import OmegaConf

    d, steps = fully_async_run
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(m["stream/staleness_max"] <= 2 for m in steps), [m["stream/staleness_max"] for m in steps]
    assert max(m["stream/multi_version_share"] for m in steps) > 0, [m["stream/multi_version_share"] for m in steps]
    for m in steps:  # each batch's staleness histogram: shares summing to 1, ending at the max, of the mean
        shares = [m[f"stream/staleness_share_{k}"] for k in range(int(m["stream/staleness_max"]) + 1)]
        assert abs(sum(shares) - 1) < 1e-9 and shares[-1] > 0, shares
        assert abs(sum(k * x for k, x in enumerate(shares)) - m["stream/staleness_mean"]) < 1e-9, m
    r = run([HPCRL, "plot", str(d), "--out", str(tmp_path / "plots")])
    assert r.returncode == 0 and "stream.png" in r.stdout, r.stderr
    # the sampler's prompts, each once (a group finished late may move to a later step)
    rows = [r for m in steps for r in m["data/prompt_rows"]]
    assert len(set(rows)) == len(rows) and sorted(rows) == sorted(r for m in grpo_reference[1][:4]
                                                                   for r in m["data/prompt_rows"])
    assert all(m["stream/gap_current_version_max"] < 1e-4 for m in steps)
    assert steps[0]["rollout_actor_logprob_gap_max"] < 1e-4  # step 1: every token is the trainer's own
    assert max(m["stream/gap_older_versions_mean"] for m in steps) > 1e-2
    assert sum(m["stream/tokens_thrown_away"] + m["stream/dropped_groups"] for m in steps) == 0
    temperature = OmegaConf.load(d / "config.yaml").rollout.temperature
    held: dict[int, list] = {}  # version -> (ids, position, recorded log-prob) of every token it made
    spanning = 0
    for step in (1, 2, 3):
        state = torch.load(d / "checkpoints" / f"step_{step:08d}" / "stream.pt", weights_only=True)
        for g in state["groups"]:
            for s in g["samples"]:
                spanning += len(set(s["versions"])) > 1
                for t, (v, lp) in enumerate(zip(s["versions"], s["logprobs"], strict=True)):
                    held.setdefault(v, []).append((g["prompt"] + s["tokens"], len(g["prompt"]) + t, lp))
    assert spanning > 0 and sorted(held) == [0, 1, 2], (spanning, sorted(held))
    worst = {}
    for v, tokens in held.items():
        model = REPO / "models" / "tiny-qwen2"
        if v:
            model = tmp_path / f"v{v}"
            r = hpcrl_cli("ckpt", "export-hf", str(d), "--step", str(v), "--out", str(model))
            assert r.returncode == 0, r.stderr[-3000:]
        seqs = list({tuple(ids) for ids, _, _ in tokens})
        width = max(map(len, seqs))
        batch = {"input_ids": torch.tensor([list(q) + [0] * (width - len(q)) for q in seqs]),
                 "attention_mask": torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])}
        lp = hf_token_logprobs(model, batch, temperature)
        row = {q: i for i, q in enumerate(seqs)}
        worst[v] = max(abs(float(lp[row[tuple(ids)], pos]) - rec) for ids, pos, rec in tokens)
    print("fully_async: |HF - recorded| per version:", worst, "spanning samples:", spanning)
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.world
def test_long_sequence_config_runs_two_steps(tmp_path: Path) -> None:
    """configs/grpo_long_tiny.yaml end to end: samples of 2048+ tokens (prompt + forced-length
    response) trained at context parallel 2 x tensor parallel 2 with sequence parallel, 2 steps. With 2
    prompts of 2 samples a step instead of the recipe's 4 of 4 (still 2 mini-batches a step): generating 16
    samples of 2048 tokens took 47 of the test's 115 s, 8 samples a step half of that."""
    d = tmp_path / "run"
    r = run([HPCRL, "run", "configs/grpo_long_tiny.yaml", f"trainer.run_dir={d}", "trainer.total_steps=2",
             "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2"], timeout=900)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    steps = read_jsonl(d / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # every response runs to max_new_tokens (rollout.min_new_tokens), so every sample is 2048+ tokens
        assert m["response_length/clip_ratio"] == 1.0, m
        assert m["prompt_length/mean"] + m["response_length/mean"] >= 2048, m
        assert m["actor/optimizer_steps"] >= 1 and m["actor/grad_norm"] > 0, m
    log = (d / "logs" / "controller.log").read_text()
    assert "actor TP=2 PP=1 CP=2 DP=1 SP" in log, log[-3000:]


def test_moe_config_runs_two_steps_and_resumes(moe_ep2: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """configs/grpo_tiny_moe.yaml end to end (tiny Qwen3-MoE, routing replay) at expert parallel 2
    (2 workers at TP=1, DP=2: each rank 4 of the 8 experts), with vLLM's fused-MoE engine at rollout TP 2
    (conftest.moe_ep2: 3 steps): the rollout-vs-actor gap of fp32 after each weight sync (0.16 nats
    before vLLM's CPU MoE weights were packed again after a reload: hpcrl.engines.vllm.cpu_moe), the
    routing metrics. Then its step-2 checkpoint (the config saves every 2 steps) resumed at EP=2 for
    step 3 equals the uninterrupted run bit for bit, from a copy of the fixture's checkpoint. (Resumed at the
    config's TP=2 with sequence parallel: tests/test_submit.py, as a Slurm job; the load-balancing loss:
    tests/programs/moe_checks.py.)"""
    from conftest import MOE_EP2
    from test_resume import resumable_copy

    ep2 = [HPCRL, "run", "configs/grpo_tiny_moe.yaml", *MOE_EP2]
    ref, steps = moe_ep2
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # fp32 on both sides: vLLM's CPU fused-MoE and megatron's experts give the same log-probs
        assert m["rollout_actor_logprob_gap_max"] < 1e-4, m
        assert m["actor/moe/tokens_per_expert_max_over_mean"] >= 1.0 and m["actor/moe/load_balancing_loss"] >= 1.0, m
        assert 0 < m["actor/moe/router_entropy"] < 2.0795, m  # below log(8 experts)
        # routing replay (the config's rollout.routing_replay): every token but each sequence's last
        # (which vLLM never routes) and the rows' padding takes vLLM's experts in the update
        assert 0.9 < m["actor/moe/replayed_share"] < 1.0, m
    assert "actor TP=1 PP=1 EP=2 DP=2, MoE 8 experts" in (ref / "logs" / "controller.log").read_text()
    ckpt = ref / "checkpoints" / "step_00000002" / "actor"
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["pp0_tp0_ep0.safetensors", "pp0_tp0_ep1.safetensors"]
    d = resumable_copy(ref, tmp_path / "run", 2)
    r = run([*ep2, f"trainer.run_dir={d}", "trainer.total_steps=3"], timeout=900)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    assert [m["step"] for m in read_jsonl(d / "metrics.jsonl")] == [1, 2, 3]
    assert "resumed from" in (d / "logs" / "controller.log").read_text()
    resumed, straight = read_jsonl(d / "metrics.jsonl")[-1], read_jsonl(ref / "metrics.jsonl")[-1]
    timing = ("time/", "throughput/", "memory/", "trace/")  # (tests/test_resume.py's TIMING)
    keys = [k for k in set(resumed) | set(straight) if not k.startswith(timing)]
    assert [k for k in keys if resumed.get(k) != straight.get(k)] == []

    def actor_digests(run_dir: Path) -> dict[str, str]:
        files = json.loads((run_dir / "checkpoints" / "step_00000003" / "manifest.json").read_text())["files"]
        items = files.items() if isinstance(files, dict) else ((f["path"], f) for f in files)
        return {path: rec["sha256"] for path, rec in items if path.startswith("actor/")}

    assert actor_digests(d) and actor_digests(d) == actor_digests(ref)
    # `hpcrl ckpt export-hf` of the EP=2 checkpoint: every HF tensor of the model (each expert from
    # its EP rank's file), trained away from the start
    r = hpcrl_cli("ckpt", "export-hf", str(d), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0 and "saved at TP=1 PP=1 EP=2" in r.stdout, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    from safetensors.torch import load_file

    start = load_file(str(REPO / "models" / "tiny-qwen3-moe" / "model.safetensors"))
    out = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(out) == sorted(start)
    experts = [k for k in start if ".mlp.experts." in k]
    assert len(experts) == 4 * 8 * 3 and sum(not torch.equal(out[k], start[k]) for k in experts) > len(experts) // 2
