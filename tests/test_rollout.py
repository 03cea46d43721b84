"""Colocated vLLM rollout with in-place resharding from the Megatron layout.

One world of 1 controller + 4 workers runs every scenario (tests/programs/rollout_checks.py): the
Megatron actor (TP=2 PP=2 on the tiny model, TP=1 PP=2 on SmolLM2-135M, whose 3 KV heads do not
split in two) and a vLLM engine in every worker; rollout TP=1 (4 replicas) and TP=2 (2 replicas).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import IN_CI, PYTHON, REPO, run

from hpcrl.launch import entry_argv, mpiexec_command
from hpcrl.launch.shm import SHM_DIR, remove_stale_segments, segment_age_s, stale_segments

SCENARIOS = ["tiny_tp1", "tiny_tp2", "smollm2_tp1"]
# + LoRA adapters at TP=1 PP=1 (DP=4): every rank holds the whole model, so nothing travels; each
# merges its own adapters into what it pushes
LORA_SCENARIO = "tiny_lora_tp1"
# + the FSDP engine with LoRA (PEFT's adapters, DP=4) -> rollout TP=2: full merged tensors gathered by every rank
FSDP_LORA_SCENARIO = "tiny_fsdp_lora_tp2"
# the tiny Qwen3-MoE: Megatron TP=2 SP -> rollout TP=1, and TP=1 -> rollout TP=2 with routing replay
MOE_SCENARIOS = ["moe_tp1", "moe_tp2"]


@pytest.fixture(scope="module")
def killed_world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A rollout TP=2 world SIGKILLed after start (tests/programs/rollout_checks.py `die`): what it
    left in /dev/shm. The main world below starts on the same machine right after."""
    out = tmp_path_factory.mktemp("rollout") / "die.json"
    r = run(mpiexec_command(2, entry_argv("tests/programs/rollout_checks.py", [str(out), "die"], python=PYTHON)),
            timeout=600)
    assert out.is_file() and r.returncode != 0, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    left = json.loads(out.read_text())
    left["present_after_kill"] = [n for n in left["segments"] if (SHM_DIR / n).exists()]
    # the next world's start removes unmapped segments older than 2 s (hpcrl/launch/shm.py)
    ages = [segment_age_s((SHM_DIR / n).stat(), time.time()) for n in left["present_after_kill"]]
    time.sleep(max(0.0, 2.5 - min(ages, default=2.5)))
    return left


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory, killed_world: dict) -> dict:
    out = tmp_path_factory.mktemp("rollout") / "checks.json"
    cmd = mpiexec_command(4, entry_argv("tests/programs/rollout_checks.py", [str(out)], python=PYTHON))
    r = run(cmd, timeout=900)
    assert r.returncode == 0 and out.is_file(), f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", [*SCENARIOS, LORA_SCENARIO, FSDP_LORA_SCENARIO, *MOE_SCENARIOS])
def test_vllm_logprobs_match_actor_after_each_reshard(checks: dict, scenario: str) -> None:
    s = checks[scenario]
    assert s["gap_after_reshard_1"] < 1e-4, s
    # the optimizer step really changed the weights: the actor moved and the stale rollout lags
    assert s["actor_change"] > 1e-3 and s["gap_stale"] > 1e-3, s
    assert s["update"]["optimizer_steps"] == 1
    # between the two reshards the freed KV cache was given back full of NaN (what a recycled heap
    # allocation may hold: CI once saw a NaN gap here); vLLM's CPU attention reads the unwritten
    # slots of a partly filled block, so waking must hand back zeros, as vLLM allocated it
    assert all(n > 0 for n in s["kv_cache_nan_filled_bytes"]), s["kv_cache_nan_filled_bytes"]
    assert s["gap_after_reshard_2"] < 1e-4, s
    # the phase switch around it: vLLM sleeps on GPU (weights to host, KV cache freed) and on CPU
    # frees both (hpcrl.engines.vllm.cpu_sleep); the gap after reshard 2 above shows that the
    # reload gave back every weight. The trainer is offloaded (actor.offload=true here) only from GPUs.
    on_gpu = torch.cuda.is_available()
    e = s["enter_training"]
    assert e["rollout_slept"] and e["trainer_onloaded"] == on_gpu, e
    if not on_gpu:  # at least the KV cache (>= 1/16 GiB) and the embedding were freed
        assert e["rollout_released_gb"] > (1 << 30) / 16 / 1e9, e
    assert all(st["trainer_offloaded"] == on_gpu for st in s["reshard_2"])


def test_layouts_are_independent(checks: dict) -> None:
    assert checks["tiny_tp1"]["layout"] == {"tp": 2, "pp": 2, "dp": 1}
    assert checks["tiny_tp1"]["rollout_coords"] == [[0, 0], [1, 0], [2, 0], [3, 0]]
    assert checks["tiny_tp2"]["rollout_coords"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert checks["smollm2_tp1"]["layout"] == {"tp": 1, "pp": 2, "dp": 2}
    assert checks[LORA_SCENARIO]["layout"] == {"tp": 1, "pp": 1, "dp": 4}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_memory_plan_terms_match_what_a_rollout_rank_holds(checks: dict, scenario: str) -> None:
    """hpcrl plan's rollout terms, one by one, against what each rank of this world holds (docs/planner.md):
    the KV cache vLLM allocated (its kv_caches tensors: the planned bytes in whole blocks), and the
    reshard's largest live transfer + conversion buffers (the plan's bucket and its converted copy)."""
    s = checks[scenario]
    planned = s["planned"]
    for measured in s["kv_cache_bytes"]:
        assert 0.99 * planned["kv_cache"] <= measured <= planned["kv_cache"], (measured, planned)
    # measured: the KV cache exactly as planned (64 MiB tiny, 70.3 MiB SmolLM2); the reshard's peak
    # exactly the plan's 2 x the largest bucket on the tiny model (1.97 MB), 4.6 kB below it on SmolLM2
    peak = max(st["peak_extra_bytes"] for st in s["reshard_2"])
    assert 0.95 * planned["reshard"] <= peak <= planned["reshard"], (peak, planned)


@pytest.mark.parametrize("scenario", [*SCENARIOS, "moe_tp1"])
def test_reshard_moves_only_what_is_missing_in_bounded_buckets(checks: dict, scenario: str) -> None:
    s = checks[scenario]
    for st in s["reshard_2"]:
        assert st["buckets"] >= 4 and st["tensors_pushed"] > 0
        # every rank needs every full HF tensor (vLLM's reload slices its TP part itself), so the
        # minimum is the model less this rank's own shard (replicas of a part are not sent it)
        assert 0 < st["bytes_received"] == st["min_bytes_received"] < st["model_bytes"]
        # no rank materialises the model: at most the transfer buffers and the converted copy of
        # one bucket; a bucket passes the bound only when one unit (a layer, the embedding) does
        assert st["largest_bucket_bytes"] <= max(st["bucket_bytes"], st["largest_unit_bytes"]), st
        assert st["peak_extra_bytes"] <= 2 * st["largest_bucket_bytes"], st
        if scenario.startswith("smollm2"):  # 30 layers (the tiny model's 2 layers are 2 units)
            assert st["peak_extra_bytes"] < st["model_bytes"] / 2, st


def test_moe_reshard_bytes_equal_a_count_by_hand(checks: dict) -> None:
    """Megatron TP=2 -> rollout TP=1: each rank receives the other TP rank's part of every tensor, the
    experts' included (fused into vLLM's w13 / w2 on arrival), the replicated router and norms too."""
    from safetensors import safe_open

    h = safe_open(str(REPO / "models" / "tiny-qwen3-moe" / "model.safetensors"), framework="pt")
    per_rank = 0
    for k in h.keys():
        n = h.get_slice(k).get_shape()
        nbytes = 4 * int(torch.Size(n).numel())
        replicated = "norm" in k or k.endswith("mlp.gate.weight")  # norms, q/k norms, routers
        per_rank += nbytes if replicated else nbytes // 2
    assert checks["moe_tp1"]["layout"] == {"tp": 2, "pp": 1, "dp": 2}
    for st in checks["moe_tp1"]["reshard_2"]:
        assert st["bytes_received"] == st["min_bytes_received"] == per_rank, (st, per_rank)


def test_routing_replay_uses_vllms_experts_for_every_token(checks: dict) -> None:
    """vLLM records the experts of every token it computed (all but each sequence's last, never fed
    back); the actor's routers replaying them use exactly those. Routing on their own they choose the
    same (fp32: the same router logits within 1e-6, the tiny model's top-2 margins >= 7e-4). The
    control: with 30% of the tokens given another first expert, the routers use the changed experts
    and the log-probs move away from vLLM's, so the replay is not the free routing by coincidence."""
    r = checks["routing_replay"]
    assert r["layers"] == 4 and r["k"] == 2 and r["unknown_are_last_tokens"], r
    assert r["known"] == r["tokens"] - r["rows"], r
    assert r["replayed_differ"] == 0 and r["free_differ"] == 0, r
    assert r["changed_tokens"] > 0.2 * r["known"], r
    assert r["replayed_changed_differ"] == 0, r
    assert r["replayed_changed_vs_original"] == r["changed_tokens"] * r["layers"], r
    assert r["gap_replay"]["rollout_actor_logprob_gap_max"] <= 1e-4, r
    assert r["gap_changed"]["rollout_actor_logprob_gap_max"] > 1e-2, r


def test_greedy_vllm_equals_hf_greedy(checks: dict) -> None:
    g = checks["greedy"]
    assert g["prompts"] == 16 and g["prompt_order"]
    assert g["equal"] == 16, g
    assert min(g["lengths"]) > 0
    assert checks["tiny_tp2"]["greedy_equal_hf_after_export"] == 16


def test_sampling_n_topk_topp_stop_and_logprob_gap(checks: dict) -> None:
    s = checks["sampling"]
    assert s["rows"] == 18 and s["prompt_index"] == [i for i in range(6) for _ in range(3)]
    assert s["prompt_prefix_ok"] and 0 < s["max_response_len"] <= 16
    assert s["distinct_completions"] > 6  # temperature 1: the 3 samples of a prompt differ
    assert s["reproducible"]  # per-sample seeds: the same seed gives the same completions
    # vLLM reports the log-probs of the distribution that sampled: with top-p / top-k that is the
    # truncated, renormalised one, which the trainer (temperature only, as verl and TRL) does not
    # model, so the gap is the log of the kept probability mass (> 0, < a few nats)
    assert 0 < s["gap"]["rollout_actor_logprob_gap_mean"] < 5, s["gap"]
    # stop strings: every completion either ends where the stop string appears, or never met it
    assert s["stop_hits_before"] > 0 and s["ended_at_stop"] > 0 and s["stopped_shorter"]
    assert s["ended_at_stop"] + s["unchanged_without_stop"] == s["rows_stopped_run"] == 18


def test_logprobs_at_temperature_match_the_actor(checks: dict) -> None:
    t = checks["temperature"]
    assert t["tokens"] > 100
    # vLLM's processed log-probs at T=0.7 and the actor's log_softmax(logits / 0.7), fp32
    assert t["gap"]["rollout_actor_logprob_gap_mean"] <= 1e-4, t
    assert t["gap"]["rollout_actor_logprob_gap_max"] <= 1e-3, t
    # the actor at T=1 (the old behaviour) is far off: the check can fail
    assert t["gap_actor_at_t1"]["rollout_actor_logprob_gap_mean"] > 1e-2, t


def test_vllm_samples_exactly_from_the_tempered_distribution(checks: dict) -> None:
    """Equal reported log-probs do not make equal draws: vLLM's T=0.7 samples against HF's
    softmax(logits / 0.7), as a z-score that is ~N(0, 1) when the draws are exact (measured +0.56;
    samples drawn at 0.5, 0.6, 0.85 and 1.0 gave +0.05, +0.30, +0.54, +0.30 under their own T). With
    vLLM made to sample at T=1 when asked for 0.7, z was -5.18 and this test failed."""
    e = checks["temperature"]["exact"]
    assert e["tokens"] > 2000, e
    assert abs(e["z"]) < 3.5, e
    # the power of the check: the same draws under T=1's distribution are far off (measured +6.09)
    assert e["z_under_t1"] > 5, e


def test_no_two_samples_share_a_random_stream(checks: dict) -> None:
    s = checks["streams"]
    assert s["rows"] == 6 and s["min_len"] > 0
    assert s["distinct_of_first_prompt"] == 4, s  # both copies' 2 samples all differ


def test_seeded_sampling_over_the_engine_token_budget(checks: dict) -> None:
    """A seeded call whose prompts exceed vLLM's max_num_batched_tokens on every replica completes
    (it crashed in vLLM's chunked prefill on CPU: 'CPU Generator does not use offset')."""
    b = checks["over_token_budget"]
    assert b["prompt_tokens"] > 4096 * b["replicas"], b  # the budget is exceeded on each replica
    assert b["rows"] == 320 and b["prompt_order"] and b["min_response_len"] >= 1, b


def test_multi_turn_rows_are_what_vllm_was_fed_and_wrote(checks: dict) -> None:
    """The multi-turn loop on the 4 replicas (toy marker format: a turn that writes "e" calls
    text_stats; hpcrl/agents/toy.py), each row checked position by position in rollout_checks.py."""
    mt = checks["multi_turn"]
    assert mt["rows"] == 24 and mt["bad_rows"] == [], mt["bad_rows"]
    # calls happened and every tool turn is the template's rendering of the tool's answer
    assert mt["tool_turns"] > 0 and mt["tool_turns_ok"] == mt["tool_turns"], mt["tool_turn_mismatches"]
    assert mt["tool_tokens"] > 0 and mt["model_tokens"] > 0
    assert all(stop == ["e"] for stop in mt["stops"])  # the format's stop string, every turn
    assert len(mt["stops"]) == max(mt["turns"])  # one batched call per turn
    # limits: 3 turns, 64 tokens after the prompt
    assert max(mt["turns"]) <= 3 and max(mt["used"]) <= 64, mt
    assert sum(mt["turns"]) == mt["turns_served"]
    m = mt["metrics"]
    assert m["multi_turn/turns_max"] == max(mt["turns"]) and m["multi_turn/tokens_after_prompt_max"] <= 64
    ends = {e: mt["ends"].count(e) / 24 for e in ("answer", "max_turns", "budget", "turn_length")}
    assert all(m[f"multi_turn/ended_{e}"] == pytest.approx(v) for e, v in ends.items()), (m, ends)
    assert sum(ends.values()) == pytest.approx(1.0)
    # failing calls are answered with an error, counted, and the conversations go on
    assert m["multi_turn/tool_errors"] == mt["errors_counted"] > 0
    assert m["multi_turn/tool_timeouts"] == mt["timeouts_counted"]


def test_multi_turn_logprobs_on_model_tokens_match_the_actor(checks: dict) -> None:
    mt = checks["multi_turn"]
    # vLLM's log-probs of the model's tokens against the actor's (fp32, T=1), tool tokens excluded
    assert mt["gap"]["rollout_actor_logprob_gap_max"] <= 1e-4, mt["gap"]
    assert mt["actor_lp_outside_mask"] == 0.0  # response_only: nothing computed on tool tokens
    # tool tokens are context: the response's holes change nothing in the packing (shared prompt on
    # and off) or against a full forward over every position
    assert mt["shared_vs_unshared"] <= 1e-5 and mt["response_only_vs_full"] <= 1e-5, mt
    # seeds: one turn of the loop is generate() with the same seed (and the marker as stop string)
    assert mt["one_turn_equals_generate"] and mt["one_turn_logprob_diff"] <= 1e-5, mt


def test_sample_seeds_are_distinct_and_split_independent() -> None:
    from hpcrl.engines.vllm.engine import sample_seed

    n, prompts = 4, 64
    whole = [sample_seed(12345, i, j, n) for i in range(prompts) for j in range(n)]
    assert len(set(whole)) == prompts * n
    # a replica holding prompts 32..63 (first_index 32) gives them the same seeds
    assert [sample_seed(12345, 32 + i, j, n) for i in range(32) for j in range(n)] == whole[32 * n:]


def test_a_killed_rollout_world_does_not_break_the_next(killed_world: dict, checks: dict) -> None:
    # the SIGKILLed world left shared-memory segments behind (MPICH's; vLLM's too where its CPU
    # shm communicator is active): the fault is real
    left = killed_world["present_after_kill"]
    assert left, killed_world
    # the next world (the main one, above, rollout TP=2 as well) removed them at start
    assert not [n for n in left if (SHM_DIR / n).exists()], left
    # vLLM's names: one random prefix per engine, agreed by the ranks of a TP group, no "/" (it was
    # `-tp:1-[0-1]-cpushm` for every job on the node)
    before, now = killed_world["vllm_shm_names"], checks["tiny_tp2"]["vllm_shm_names"]
    for names in (before, now):
        prefixes = {n["name"].split("-tp:")[0] for n in names}
        assert len(prefixes) == 1 and prefixes.pop().startswith("hpcrl-"), names
        assert all("/" not in n["name"] and n["name"].endswith("cpushm") for n in names), names
    assert now[0]["name"] == now[1]["name"] != now[2]["name"] == now[3]["name"]  # 2 TP groups of 2
    assert before[0]["name"].split("-tp:")[0] != now[0]["name"].split("-tp:")[0]
    segments = checks["tiny_tp2"]["shm_segments"]
    # the segments exist only where vLLM's CPU build has its shm ops (x86 and ARM builds have them):
    # under CI=true a build without them fails here instead of passing without the check below
    assert now[0]["active"] or not IN_CI, f"vLLM's CPU shm communicator is off in this build: {now}"
    if now[0]["active"]:
        assert any(n.startswith(now[0]["name"]) for n in segments), (now, segments)
    # a world that ends normally leaves nothing
    assert segments and not [n for n in segments if (SHM_DIR / n).exists()], segments


def test_an_engine_closed_at_the_run_end_skips_the_collections_and_leaves_no_segment(checks: dict) -> None:
    """A run's end closes its engines with final=True (hpcrl/engines/vllm/engine.py `close`): vLLM's
    shutdown and hpcrl's close then run no full garbage collection (each walks every object of a worker,
    ~0.5 s of CPU; 6 CPU-s of a 2-step tiny run, 2026-12-07), and what the engine held in /dev/shm is
    still gone after the world ends. The control: the same count sees the collections of a close that
    another engine follows."""
    assert all(n >= 2 for n in checks["tiny_tp2"]["full_collections_in_close"]), checks["tiny_tp2"]
    final = checks["final_close"]
    assert final["full_collections_in_close"] == [0, 0, 0, 0], final
    names = final["vllm_shm_names"]
    assert names[0]["active"] or not IN_CI, f"vLLM's CPU shm communicator is off in this build: {names}"
    if names[0]["active"]:
        assert any(n.startswith(names[0]["name"]) for n in final["shm_segments"]), final
    assert final["shm_segments"] and not [n for n in final["shm_segments"] if (SHM_DIR / n).exists()], final


def test_stale_segments_are_the_unused_old_ones(tmp_path) -> None:
    names = ["mpich_shm_0badc0de_0", "hpcrl-x-tp:1-[0-1]-cpushm_0", "hpcrl-x-tp:1-[0-1]-cpushm_1", "other_0"]
    for n in names:
        (tmp_path / n).write_bytes(b"\0" * 4096)
    # a live process maps one of them (as a running job does)
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); "
                               "m = mmap.mmap(f.fileno(), 4096); f.close(); print('ok', flush=True); time.sleep(60)",
                               str(tmp_path / names[2])], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        assert stale_segments(tmp_path, min_age_s=0) == [tmp_path / names[1], tmp_path / names[0]]
        # younger than the bound: a segment another job may have created and not yet mapped
        assert remove_stale_segments(tmp_path, min_age_s=30) == []
        assert remove_stale_segments(tmp_path, min_age_s=0) == [tmp_path / names[1], tmp_path / names[0]]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    finally:
        holder.kill()
        holder.wait()


def test_generation_spans_are_bounded_between_drains() -> None:
    """A colocated run never drains its workers' generation spans (only the split placement's
    controller does, every step): they keep the last MAX_GENERATION_SPANS instead of growing with
    every generate call of a run of days."""
    from hpcrl.workers.actor_rollout import MAX_GENERATION_SPANS, RolloutMethods

    worker = RolloutMethods()
    for i in range(3 * MAX_GENERATION_SPANS):
        worker._spans().append([float(i), float(i) + 0.5])
    spans = worker.generation_spans()
    last = 3.0 * MAX_GENERATION_SPANS - 1
    assert len(spans) == MAX_GENERATION_SPANS and spans[-1] == [last, last + 0.5]
    assert worker.generation_spans() == []  # drained


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_woken_kv_cache_is_zero_without_becoming_resident() -> None:
    """What vLLM's KV cache gets at every wake on CPU (hpcrl.engines.vllm.cpu_sleep.wake): zeros
    where NaN bytes were (the unwritten slots of a block must be finite), and no page made resident
    by it (a step writes only the blocks its sequences use; filling the cache made all of it resident)."""
    from hpcrl.engines.vllm.cpu_sleep import zero_lazily

    n = (64 << 20) // 4 + 3  # partial pages at both ends (glibc's large blocks start 16 bytes into a page)
    cache = torch.full((n,), float("nan"))
    before = _resident_bytes()
    zero_lazily(cache.untyped_storage())
    after = _resident_bytes()
    assert before - after > 0.9 * 4 * n, (before, after)
    assert int(torch.count_nonzero(cache)) == 0


def test_freed_tensors_are_handed_back_to_the_kernel() -> None:
    """What a worker does before every reshard (ActorRolloutRole.enter_rollout): glibc keeps freed
    blocks under its mmap threshold resident for reuse, so the update's freed activations stayed in
    the resident set beside the woken vLLM weights; return_free_heap gives their pages back."""
    from hpcrl.workers.memory import return_free_heap

    torch.empty(4 << 20)  # freed at once: a freed 16 MB block raises glibc's mmap threshold (as the update's do)
    blocks = [torch.ones(2 << 20) for _ in range(80)]  # 80 x 8 MB, now from the heap, written
    kept = blocks[1::2]  # every other block stays: the freed ones are holes the heap's top cannot give back
    before = _resident_bytes()
    del blocks
    freed_but_resident = _resident_bytes()
    trimmed = return_free_heap()
    after = _resident_bytes()
    size = 40 * (8 << 20)
    assert before - freed_but_resident < 0.1 * size, "glibc returned the blocks by itself: the test shows nothing"
    assert trimmed > 0.9 * size and freed_but_resident - after > 0.9 * size, (before, freed_but_resident, after)
    assert all(int(k[-1]) == 1 for k in kept)
