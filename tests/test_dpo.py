"""DPO: the loss against hand computation, preference data, configs, the update against an independent
step, a tiny run that learns, and its bit-exact resume.

- The loss and metrics (hpcrl.algos.dpo) equal values computed here from the formulas with Python's
  math module (sigmoid DPO, conservative DPO with label smoothing, IPO).
- Preference data (hpcrl.data.preference): both forms of TRL's schema tokenise to the same prompt
  + response ids, token-exact with the chat template; bad rows are skipped up to a share and refused
  above it; a file without the preference columns is refused by name.
- Configs that cannot run DPO are refused naming the key.
- tests/programs/dpo_checks.py (one 1 + 4 rank world): one `update_dpo` in 6 layouts and
  micro-batchings (a pair's two responses in one micro-batch, or apart; TP, PP, DP 2 and 4) gives
  the gradient and metrics of a plain-PyTorch DPO / IPO step on the HF model.
- `hpcrl run configs/dpo_tiny.yaml` (10 steps, module fixture): preference accuracy on the held-out
  pairs rises; the records, validations and checkpoints are those of an RL run.
- A copy of that run, its whole MPI world SIGKILLed in a save, then its resumed run stopped by
  SIGTERM, ends with the same weights, optimizer state, RNG streams and step records.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import HPCRL, PYTHON, REPO, TINY_MODEL, hpcrl_cli, read_jsonl, run

from hpcrl.algos.dpo import dpo_loss, dpo_metrics, dpo_pair_stats
from hpcrl.config import ConfigError, load_config
from hpcrl.data import PreferenceDataset, scan_preference_rows
from hpcrl.trainer.dpo import preference_batch, validation_batches
from hpcrl.trainer.preflight import preflight
from hpcrl.workers.megatron_roles import dpo_pair_rows

DPO_TINY = REPO / "configs" / "dpo_tiny.yaml"
PREF = REPO / "data" / "pref"


# the loss, by hand ------------------------------------------------------------------------------
# (policy chosen, policy rejected, reference chosen, reference rejected) sums of four pairs: a pair
# the policy prefers more than the reference, one it prefers less, a tie, a large margin
PAIRS = [(-10.0, -14.0, -11.0, -13.5), (-20.0, -18.0, -21.0, -20.5), (-7.0, -7.0, -7.0, -7.0),
         (-3.0, -60.0, -30.0, -31.0)]
# the chosen and rejected responses' token counts (EOS included) of each pair: IPO averages over them
TOKENS = [(4, 8), (10, 5), (3, 3), (2, 40)]


def hand_loss(pc: float, pr: float, rc: float, rr: float, beta: float, kind: str, eps: float,
              tokens: tuple[int, int] = (1, 1)) -> float:
    h = (pc - rc) - (pr - rr)
    if kind == "ipo":  # Azar et al. 2023, eq. 17 (tau = beta), each log-ratio averaged over its tokens (TRL)
        h_avg = (pc - rc) / tokens[0] - (pr - rr) / tokens[1]
        return (h_avg - 1.0 / (2.0 * beta)) ** 2
    # -log sigmoid(x) = log(1 + e^-x); conservative DPO: labels flipped with probability eps
    return (1.0 - eps) * math.log1p(math.exp(-beta * h)) + eps * math.log1p(math.exp(beta * h))


def hand_metrics(beta: float, kind: str, eps: float) -> dict[str, float]:
    n = len(PAIRS)
    rewards_c = [beta * (pc - rc) for pc, _, rc, _ in PAIRS]
    rewards_r = [beta * (pr - rr) for _, pr, _, rr in PAIRS]
    return {"loss": sum(hand_loss(*p, beta, kind, eps, t) for p, t in zip(PAIRS, TOKENS)) / n,
            "rewards/chosen": sum(rewards_c) / n, "rewards/rejected": sum(rewards_r) / n,
            "rewards/margins": sum(c - r for c, r in zip(rewards_c, rewards_r)) / n,
            "rewards/accuracies": sum(c > r for c, r in zip(rewards_c, rewards_r)) / n,
            "logps/chosen": sum(p[0] for p in PAIRS) / n, "logps/rejected": sum(p[1] for p in PAIRS) / n,
            "logps/accuracies": sum(p[0] > p[1] for p in PAIRS) / n, "pairs": float(n)}


@pytest.mark.parametrize("beta,kind,eps", [(0.1, "sigmoid", 0.0), (0.5, "sigmoid", 0.2), (0.1, "ipo", 0.0),
                                           (2.0, "ipo", 0.0)])
def test_loss_and_metrics_equal_the_formulas(beta: float, kind: str, eps: float) -> None:
    cols = [torch.tensor(c, dtype=torch.float64) for c in zip(*PAIRS)]
    n_c, n_r = (torch.tensor(c) for c in zip(*TOKENS))
    per_pair = dpo_loss(*cols, beta=beta, loss_type=kind, label_smoothing=eps, chosen_tokens=n_c, rejected_tokens=n_r)
    expected = [hand_loss(*p, beta, kind, eps, t) for p, t in zip(PAIRS, TOKENS)]
    assert torch.allclose(per_pair, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)
    got = dpo_metrics(*cols, beta=beta, loss_type=kind, label_smoothing=eps, chosen_tokens=n_c, rejected_tokens=n_r)
    want = hand_metrics(beta, kind, eps)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= 1e-6 for k in want), (got, want)
    # the tie: rewards equal, so not counted as a preference; the sigmoid loss there is log 2
    assert dpo_pair_stats(*cols, beta=beta)["rewards/accuracies"].tolist() == [1.0, 0.0, 0.0, 1.0]
    if kind == "sigmoid":
        assert abs(float(per_pair[2]) - math.log(2.0)) < 1e-12


def test_ipo_is_length_averaged_by_hand() -> None:
    """IPO as TRL's DPOTrainer computes it: each response's log-ratio divided by its token count.
    Pair 4 by hand (beta 0.5): chosen log-ratio (-3 - -30) / 2 = 13.5, rejected (-60 - -31) / 40 =
    -0.725, h_avg = 14.225, L = (14.225 - 1)^2 = 174.900625. The summed form would be (56 - 1)^2 = 3025."""
    pc, pr, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in PAIRS[3])
    loss = dpo_loss(pc, pr, rc, rr, 0.5, "ipo", chosen_tokens=torch.tensor([2]), rejected_tokens=torch.tensor([40]))
    assert abs(float(loss) - 174.900625) < 1e-9, float(loss)
    # a response of equal length on both sides: the margin over that length
    loss = dpo_loss(pc, pr, rc, rr, 0.5, "ipo", chosen_tokens=torch.tensor([8]), rejected_tokens=torch.tensor([8]))
    assert abs(float(loss) - (56.0 / 8 - 1.0) ** 2) < 1e-9


def test_loss_gradient_is_the_formulas_derivative() -> None:
    """d L / d pi_c = -beta (1 - sigmoid(beta h)) for sigmoid DPO; 2 (h_avg - 1 / (2 beta)) / n_c for
    IPO, h_avg the length-averaged margin."""
    beta, h, n_c, n_r = 0.3, 1.7, 4, 2
    h_avg = h / n_c  # the chosen response's log-ratio is h, the rejected one's 0
    for kind, slope in (("sigmoid", -beta * (1.0 - 1.0 / (1.0 + math.exp(-beta * h)))),
                        ("ipo", 2.0 * (h_avg - 1.0 / (2.0 * beta)) / n_c)):
        pc = torch.tensor([h - 5.0], dtype=torch.float64, requires_grad=True)
        dpo_loss(pc, torch.tensor([-5.0]).double(), torch.tensor([-5.0]).double(), torch.tensor([-5.0]).double(),
                 beta,
                 kind, chosen_tokens=torch.tensor([n_c]), rejected_tokens=torch.tensor([n_r])).sum().backward()
        assert abs(float(pc.grad) - slope) < 1e-9, (kind, float(pc.grad), slope)


def test_loss_refuses_what_it_cannot_compute() -> None:
    x = torch.zeros(2)
    for kwargs, says in (({"beta": 0.0}, "beta=0"), ({"beta": 0.1, "label_smoothing": 0.5}, "< 0.5"),
                         ({"beta": 0.1, "loss_type": "ipo", "label_smoothing": 0.1}, "sigmoid only"),
                         ({"beta": 0.1, "loss_type": "ipo"}, "pass chosen_tokens and rejected_tokens"),
                         ({"beta": 0.1, "loss_type": "hinge"}, "unknown DPO loss_type")):
        with pytest.raises(ValueError, match=says):
            dpo_loss(x, x, x, x, **kwargs)


# pairs on the wire ------------------------------------------------------------------------------
def test_pair_rows_and_batches() -> None:
    chosen_rows, rejected_rows = dpo_pair_rows(torch.tensor([4, 4, 9, 9, 2, 2]), torch.tensor([0, 1, 1, 0, 1, 0]))
    assert chosen_rows.tolist() == [1, 2, 4] and rejected_rows.tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="same DP rank"):  # a pair cut between two DP shards
        dpo_pair_rows(torch.tensor([0, 0, 1]), torch.tensor([1, 0, 1]))
    assert validation_batches(10, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert validation_batches(9, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]  # 1 pair < 2: joined
    data = PreferenceDataset([str(PREF / "val.jsonl")], str(TINY_MODEL))
    pairs = [data[0], data[1]]
    b = preference_batch(pairs)
    assert b["pair_index"].tolist() == [0, 0, 1, 1] and b["chosen"].tolist() == [1, 0, 1, 0]
    for row, (p, resp) in enumerate((q, r) for q in pairs for r in (q.chosen_ids, q.rejected_ids)):
        n = len(p.prompt_ids) + len(resp)
        assert b["input_ids"][row, :n].tolist() == p.prompt_ids + resp and int(b["attention_mask"][row].sum()) == n
        assert b["response_mask"][row].nonzero().flatten().tolist() == list(range(len(p.prompt_ids), n))


# preference data --------------------------------------------------------------------------------
def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_both_forms_tokenise_token_exact_with_the_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    eos = tok.eos_token_id
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "Give 3 signs.", "chosen": "123", "rejected": "abc"}])
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Give 3 signs."}]
    conv_rows = [{"prompt": [user[1]], "chosen": [{"role": "assistant", "content": "123"}],
                  "rejected": [{"role": "assistant", "content": "abc"}]},
                 # multi-turn response, and a string response to a conversational prompt
                 {"prompt": user, "chosen": [{"role": "assistant", "content": "1"}, {"role": "user", "content": "more"},
                                             {"role": "assistant", "content": "23"}], "rejected": "abc"}]
    conv = tmp_path / "conv.parquet"
    pq.write_table(pa.Table.from_pylist(conv_rows[:1]), conv)
    a = PreferenceDataset([str(plain)], tok)[0]
    b = PreferenceDataset([str(conv)], tok)[0]
    prompt_text = tok.apply_chat_template([user[1]], add_generation_prompt=True, tokenize=False)
    assert a.prompt_ids == b.prompt_ids == tok(prompt_text, add_special_tokens=False)["input_ids"]
    # a response is its tokens + EOS; the rendered assistant turn ends with the same EOS (its newline cut)
    assert a.chosen_ids == b.chosen_ids == tok("123", add_special_tokens=False)["input_ids"] + [eos]
    assert a.rejected_ids == b.rejected_ids == tok("abc", add_special_tokens=False)["input_ids"] + [eos]
    multi = PreferenceDataset([str(write_jsonl(tmp_path / "multi.jsonl", conv_rows[1:]))], tok)[0]
    full = tok.apply_chat_template(user + conv_rows[1]["chosen"], tokenize=False)
    assert tok.decode(multi.prompt_ids + multi.chosen_ids) == full.rstrip("\n") and multi.chosen_ids[-1] == eos
    assert multi.chosen_ids.count(eos) == 3  # each assistant / user turn closes with its own <|im_end|>
    assert multi.rejected_ids == tok("abc", add_special_tokens=False)["input_ids"] + [eos]


def test_bad_rows_are_skipped_up_to_the_share_and_refused_above(tmp_path: Path) -> None:
    good = [{"prompt": f"Give {i} signs.", "chosen": "1" * (i + 1), "rejected": "a" * (i + 1)} for i in range(18)]
    bad = [{"prompt": "x", "chosen": "1"}, {"prompt": "x", "chosen": "same", "rejected": "same"}]
    f = write_jsonl(tmp_path / "d.jsonl", good[:9] + bad + good[9:])
    scan = scan_preference_rows(f)
    assert scan.total == 20 and len(scan.rows) == 18
    assert "row 9 has no 'rejected'" in scan.problems[0] and "row 10: 'chosen' and 'rejected' are the same" in \
        scan.problems[1], scan.problems
    data = PreferenceDataset([str(f)], str(TINY_MODEL), max_skipped_row_share=0.1)
    assert len(data) == 18 and data.num_skipped == 2
    with pytest.raises(ValueError, match=r"2 of 20 rows unusable .*row 9"):
        PreferenceDataset([str(f)], str(TINY_MODEL), max_skipped_row_share=0.05)
    # responses over max_response_length tokens (EOS included) are dropped and counted
    short = PreferenceDataset([str(f)], str(TINY_MODEL), max_response_length=10, max_skipped_row_share=0.1)
    assert len(short) == 9 and short.num_filtered == 9
    with pytest.raises(ValueError, match="no row has 'chosen'"):
        PreferenceDataset([str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "answer": "1"}]))], str(TINY_MODEL))


# configs ----------------------------------------------------------------------------------------
def dpo_problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        preflight(load_config(DPO_TINY, list(overrides)))
    return e.value.problems


@pytest.fixture
def _from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the recipe names models/ and data/ relative to the repo root


@pytest.mark.usefixtures("_from_repo_root")
@pytest.mark.parametrize("overrides,key,says", [
    (["algorithm.dpo.beta=0"], "algorithm.dpo.beta", "> 0"),
    (["algorithm.dpo.beta=-0.1"], "algorithm.dpo.beta", "> 0"),
    (["algorithm.dpo.loss_type=hinge"], "algorithm.dpo.loss_type", "sigmoid, ipo"),
    (["algorithm.dpo.label_smoothing=0.5"], "algorithm.dpo.label_smoothing", "< 0.5"),
    (["algorithm.dpo.label_smoothing=-0.1"], "algorithm.dpo.label_smoothing", ">= 0"),
    (["algorithm.dpo.loss_type=ipo", "algorithm.dpo.label_smoothing=0.1"], "algorithm.dpo.label_smoothing",
     "loss_type=sigmoid"),
    (["algorithm.name=sft"], "algorithm.name", "ppo, dpo"),
    (["reference.enable=false"], "reference.enable", "needs the reference"),
    (["critic.enable=true"], "critic.enable", "no critic"),
    (["data.train_batch_size=15"], "data.train_batch_size", "data-parallel size 2"),
    (["data.max_response_length=0"], "data.max_response_length", ">= 1"),
    (["data.train_files=[data/arith/train.parquet]"], "data.train_files[0]", "'chosen' (data.chosen_key)"),
    (["data.chosen_key=better"], "data.train_files[0]", "'better' (data.chosen_key)"),
])
def test_bad_dpo_config_is_refused_naming_the_key(overrides: list[str], key: str, says: str) -> None:
    problems = dpo_problems(*overrides)
    named = [p for p in problems if p.startswith(key)]
    assert named and says in named[0], problems


@pytest.mark.usefixtures("_from_repo_root")
def test_dpo_recipe_validates_and_the_cli_refuses_before_launch(tmp_path: Path) -> None:
    preflight(load_config(DPO_TINY))
    # the RL loop's batch arithmetic does not apply (mini-batches of samples, rollout.n)
    preflight(load_config(DPO_TINY, ["actor.ppo_mini_batch_size=7", "rollout.n=1"]))
    run_dir = tmp_path / "run"
    r = run([HPCRL, "run", str(DPO_TINY), f"trainer.run_dir={run_dir}", "algorithm.dpo.beta=0"], timeout=120)
    assert r.returncode == 2 and "algorithm.dpo.beta=0" in r.stderr and not run_dir.exists(), r.stderr


# the update against an independent step (one multi-rank world) ----------------------------------
@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from hpcrl.launch import entry_argv, mpiexec_command

    out = tmp_path_factory.mktemp("dpo-checks") / "checks.json"
    r = run(mpiexec_command(4, entry_argv("tests/programs/dpo_checks.py", [str(out)], python=PYTHON)), timeout=600)
    assert r.returncode == 0 and out.is_file(), f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_update_matches_the_independent_step_for_any_micro_batching(checks: dict) -> None:
    cases = checks["cases"]
    assert len(cases) == 6
    for name, c in cases.items():
        assert c["same_names"] and c["optimizer_steps"] == 1, (name, c)
        # fp32, one sequence per forward on the HF side: measured 7e-7 to 1.3e-6
        assert c["grad_rel"] < 1e-5, (name, c)
        for key, (got, ref) in c["metrics"].items():
            assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (name, key, got, ref)
        assert c["policy_vs_hf"] < 1e-4, (name, c)
    # every way a pair can sit: both responses in one micro-batch (one pass), all pairs apart
    # (each row alone: the extra forward), some of each; DP 4, and PP 2 with its pairs apart
    assert cases["together-tp2"]["pairs_split"] == 0 and cases["together-dp4"]["dp"] == 4
    assert cases["split-tp2"]["pairs_split"] == 8 and cases["split-pp2"]["pairs_split"] == 8
    assert 0 < cases["no-share-tp2"]["pairs_split"] < 8 and 0 < cases["padded-tp2"]["pairs_split"] < 8
    one = cases["together-tp2"]["one_row"]  # 1 row on 2 DP ranks
    assert one["rows"] == 1 and one["vs_hf"] < 1e-4


def test_nonfinite_steps_in_a_row_are_counted_across_a_checkpoint(checks: dict) -> None:
    """The count that trainer.max_nonfinite_steps stops at is saved with the checkpoint: two skipped
    steps, a save, a finite step (0), the load, a skipped step: 3, not 1 (before, a resumed run counted
    from 0 again, so a run that fails every step could requeue itself forever)."""
    assert checks["nonfinite_resume"]["in_a_row"] == [1.0, 2.0, 0.0, 3.0], checks["nonfinite_resume"]


# the tiny run -----------------------------------------------------------------------------------
RUN_STEPS = 10
# 64 training pairs, 16 per step: an epoch is 4 steps (the resume below lands on a boundary)
RUN_OVERRIDES = [f"trainer.total_steps={RUN_STEPS}", "trainer.val_every=5", "checkpoint.save_every=4",
                 "logging.tensorboard=false"]


def train_slice(folder: Path) -> Path:
    path = folder / "train64.parquet"
    if not path.exists():
        pq.write_table(pq.read_table(PREF / "train.parquet").slice(0, 64), path)
    return path


def dpo_run(run_dir: Path, data: Path, *overrides: str, env: dict[str, str] | None = None) -> list[dict]:
    r = run([HPCRL, "run", str(DPO_TINY), f"trainer.run_dir={run_dir}", f"data.train_files=[{data}]",
             *RUN_OVERRIDES, *overrides], timeout=600, env=env)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def dpo_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], Path]:
    folder = tmp_path_factory.mktemp("dpo")
    data = train_slice(folder)
    t = time.time()
    steps = dpo_run(folder / "run", data)
    print(f"dpo_tiny: {RUN_STEPS} steps in {time.time() - t:.0f} s")
    return folder / "run", steps, data


def test_dpo_with_lora_uses_the_frozen_base_as_reference(checks: dict) -> None:
    lo = checks["lora"]
    assert lo["ref_vs_hf"] < 1e-4  # adapters off = the base model's summed log-probs (HF)
    # the adapters start at B = 0: the policy is the reference, every margin 0, the loss ln 2
    assert lo["loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert lo["loss"][1] < lo["loss"][0] - 1e-3 and lo["accuracies"] > 0.5  # the step moved towards chosen
    assert lo["base_after_vs_hf"] < 1e-4 and lo["adapted_moved"] > 1e-2  # the base stayed, the policy moved


def test_preference_accuracy_on_held_out_pairs_rises(dpo_tiny: tuple[Path, list[dict], Path]) -> None:
    run_dir, _, _ = dpo_tiny
    val = {v["after_steps"]: v for v in read_jsonl(run_dir / "validation.jsonl")}
    assert sorted(val) == [0, 5, RUN_STEPS] and all(v["pairs"] == 64 for v in val.values())
    before, after = val[0], val[RUN_STEPS]
    # the policy starts as its reference: implicit rewards 0, no pair counted, loss log 2
    assert before["rewards/accuracies"] == 0 and abs(before["loss"] - math.log(2)) < 1e-6
    # measured: rewards/accuracies 0 -> 1.0, logps/accuracies 0.52 -> 1.0, loss 0.693 -> 0.106 (10 steps)
    assert after["rewards/accuracies"] >= 0.9, after
    assert after["logps/accuracies"] >= 0.9 and after["logps/accuracies"] > before["logps/accuracies"] + 0.3, val
    assert after["loss"] < 0.5 * before["loss"] and after["rewards/margins"] > 0.5, after


def test_step_records_checkpoints_and_log_are_those_of_a_run(dpo_tiny: tuple[Path, list[dict], Path]) -> None:
    run_dir, steps, _ = dpo_tiny
    assert [m["step"] for m in steps] == list(range(1, RUN_STEPS + 1))
    assert [m["data/epoch"] for m in steps] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    first, last = steps[0], steps[-1]
    assert abs(first["dpo/loss"] - math.log(2)) < 1e-6 and last["dpo/loss"] < 0.3, (first, last)
    for m in steps:
        assert m["actor/optimizer_steps"] == 1 and m["actor/nonfinite_steps_skipped"] == 0
        # each pair's prompt is packed once for both responses, in one micro-batch: the one-pass loss
        assert m["dpo/pairs_split"] == 0
        assert m["time/ref_logprob"] > 0 and m["time/update_actor"] > 0 and m["throughput/tokens_per_s"] > 0
        assert 0.1 < m["memory/rss_gb_mean"] <= m["memory/rss_gb_max"] < 3, m
        assert m["response_length/chosen_mean"] >= 5  # 4-10 characters + EOS
    assert "val/rewards/accuracies" in steps[0] and "val/loss" in steps[5] and "val/loss" not in steps[1]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000008", "step_00000010"]
    assert hpcrl_cli("ckpt", "verify", str(run_dir)).returncode == 0
    log = (run_dir / "logs" / "controller.log").read_text()
    assert log.count(f"step {RUN_STEPS}/{RUN_STEPS} | loss ") == 1 and " | acc " in log and " | margin " in log


def rank0_pid(run_dir: Path) -> int | None:
    """The controller (MPI rank 0) of the local run writing into run_dir, or None (yet)."""
    from test_resume import processes

    for pid, argv in processes().items():
        if b"hpcrl_entry.py" in argv and f"trainer.run_dir={run_dir}".encode() in argv:
            try:
                env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in kv)
            except OSError:
                continue
            if env.get(b"PMI_RANK") == b"0":
                return pid
    return None


def wait_for_text(path: Path, text: str, count: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 600
    while not (path.exists() and path.read_text(errors="replace").count(text) >= count):
        assert proc.poll() is None and time.time() < deadline, f"{what}: the run ended or timed out"
        time.sleep(0.05)


def test_killed_then_stopped_run_resumes_bit_exact(dpo_tiny: tuple[Path, list[dict], Path], tmp_path: Path) -> None:
    """Two interruptions of a copy of the fixture's run (the same saves), then a run to the end:
    1. kill -9 of the whole MPI world (controller and workers) in the save of step 8: the half-written
       step 8 is never taken for a checkpoint, the rerun resumes from step 4, exactly at an epoch
       boundary ("continuing at step 5");
    2. SIGTERM to the controller of that rerun once it has done step 5 (what a preemption sends):
       it saves at the next step boundary and stops with status 0;
    3. the last rerun resumes from there, its save of step 8 removes the killed save's debris, and it
       ends as the run that never stopped: weights, optimizer state, RNG streams, step records and
       validations.
    The checkpoint store is the same for every algorithm and engine: this is also GRPO's world killed in a
    save (that test, 3 more worlds with vLLM, merged here with its checks: issue 54)."""
    from test_resume import processes, same_records, shard_digests

    whole_dir, whole, data = dpo_tiny
    run_dir = tmp_path / "run"
    args = [HPCRL, "run", str(DPO_TINY), f"trainer.run_dir={run_dir}", f"data.train_files=[{data}]", *RUN_OVERRIDES]
    err = tmp_path / "first.err"
    # 1. rank 2 dies as its second save (step 8) begins; then the test SIGKILLs every other process
    # of the world (hpcrl/launch/faults.py)
    with open(err, "w") as f:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f,
                                env={**os.environ, "HPCRL_FAULT": "0:2:save_checkpoint:2"})
    try:
        wait_for_text(err, "[hpcrl fault]", 1, proc, "the fault in the save of step 8")
        world = [pid for pid, argv in processes().items()
                 if b"hpcrl_entry.py" in argv and f"trainer.run_dir={run_dir}".encode() in argv]
        for pid in world:
            os.kill(pid, 9)
        assert len(world) >= 4, world
        proc.wait(timeout=60)
    finally:
        proc.kill()
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "step_00000004").exists() and not (ckpts / "step_00000008").exists()
    half = [p.name for p in ckpts.iterdir() if "step_00000008" in p.name]  # the save the kill cut short
    assert half and all(name.startswith(".tmp-step_00000008-") for name in half), sorted(os.listdir(ckpts))
    # 2. resumed from step 4 (the killed run logged step 5 once already)
    log = run_dir / "logs" / "controller.log"
    with open(tmp_path / "second.err", "w") as f:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    try:
        wait_for_text(log, f"step 5/{RUN_STEPS} |", 2, proc, "step 5 after the resume")
        controller = rank0_pid(run_dir)
        assert controller is not None
        os.kill(controller, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    text = log.read_text()
    stopped = re.search(rf"stopping after step (\d+) of {RUN_STEPS}: signal SIGTERM; checkpoint saved", text)
    assert stopped and 5 <= int(stopped.group(1)) < RUN_STEPS, text[-3000:]
    assert f"resumed from {ckpts}/step_00000004" in text, text[-3000:]
    assert f"continuing at step 5 of {RUN_STEPS}" in text, text[-3000:]
    # 3. to the end
    steps = dpo_run(run_dir, data)
    text = log.read_text()
    assert [int(m) for m in re.findall(r"resumed from \S+step_(\d+)", text)] == [4, int(stopped.group(1))]
    assert [m["step"] for m in steps] == list(range(1, RUN_STEPS + 1))
    # the save of step 8 (a new temporary folder) removed the killed save's (hpcrl.checkpoint.store)
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".tmp-step_00000008")]  # debris removed
    assert same_records(whole, steps) == []
    ref, got = shard_digests(whole_dir, RUN_STEPS), shard_digests(run_dir, RUN_STEPS)
    assert any(p.endswith(".safetensors") for p in ref) and any(p.startswith("rng/") for p in ref) and ref == got
    last = {v["after_steps"]: v for v in read_jsonl(run_dir / "validation.jsonl")}[RUN_STEPS]
    assert last == {v["after_steps"]: v for v in read_jsonl(whole_dir / "validation.jsonl")}[RUN_STEPS]
