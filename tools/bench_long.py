"""Long-sequence benchmark (not CI): peak memory per rank and update time of one actor update on one
long sequence at context parallel 1, 2 and 4, then `hpcrl plan` for 7B / 32B models at long samples.

    .venv/bin/python tools/bench_long.py [--tokens 8192 --cps 1 2 4 --recompute full]

Each CP runs in a world of its own with CP workers (DP 1, TP 1: SmolLM2-135M has 3 KV heads), fp32,
on one sequence of --tokens random tokens (after a prompt of --prompt-share of them, the response,
with a loss). A rank holds
tokens / CP of it. What a rank's update adds to its resident set (VmHWM from the start of the
update, after the heap's free pages were handed back and a short warm-up update allocated AdamW's
state) minus its gradients' bytes is its activation memory; the goal is activation(CP) within 15% of
activation(1) / CP. Ranks share this machine's cores: update times at CP > 1 are not a speed-up claim.
Run it alone on the machine; load average and steal time are printed with each result.

Then the planner (`hpcrl plan`) for Qwen2.5-7B at 32k-token samples on 2 nodes x 8 x 80 GB and for
Qwen2.5-32B at 16k on 4 nodes x 8 x 80 GB, each without context parallel and with the CP it names.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = REPO / "models" / "smollm2-135m-instruct"

from hpcrl.controller.dispatch import Collect, Dispatch, register  # noqa: E402
from hpcrl.workers.megatron_roles import MegatronRole  # noqa: E402


class PeakRole(MegatronRole):
    """An actor update that reports the rise of its resident set's high-water mark, its time, and the
    bytes of this rank's gradients."""

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.ALL)
    def measured_update(self, batch: Any) -> dict[str, Any]:
        from hpcrl.workers.memory import peak_memory, return_free_heap

        return_free_heap()
        peak_memory(reset=True)
        start = peak_memory(reset=True)["rss_gb"]
        t0 = time.perf_counter()
        metrics = self.update_actor(batch)
        seconds = time.perf_counter() - t0
        grads = sum(p.numel() * 4 for p in self.engine.trainable)  # fp32 gradients, made in the backward
        return {"peak_above_start_gb": peak_memory(reset=True)["rss_gb"] - start, "update_s": seconds,
                "grad_gb": grads / 1e9, "metrics": metrics, "start_gb": start}


def steal_seconds() -> float:
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    return int(cpu[8]) / os.sysconf("SC_CLK_TCK") if len(cpu) > 8 else 0.0


def child(spec_path: str, out_path: str) -> None:
    """The controller program of one world (rank 0): build the actor, warm up, measure one update."""
    import torch
    from omegaconf import OmegaConf

    from hpcrl.config import load_config
    from hpcrl.controller import Batch, WorkerGroup
    from hpcrl.workers.batching import arrange_minibatches

    spec = json.loads(Path(spec_path).read_text())
    cp, tokens = spec["cp"], spec["tokens"]
    cfg = OmegaConf.to_container(load_config(REPO / "configs" / "grpo_smollm2.yaml", [
        f"model.path={MODEL}", "model.dtype=fp32", f"actor.parallel.context_parallel={cp}",
        f"actor.recompute={spec['recompute']}", f"actor.micro_batch_tokens={tokens}", "actor.ppo_mini_batch_size=1",
        "data.train_batch_size=1", "rollout.n=1", "actor.use_kl_loss=false", "actor.entropy_coeff=0.0",
        f"trainer.workers_per_node={cp}", "trainer.nnodes=1"]), resolve=True)

    def batch_of(length: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 49000, (1, length), generator=g)
        resp = torch.zeros(1, length)
        resp[:, int(length * spec["prompt_share"]):] = 1
        b = Batch({"input_ids": ids, "attention_mask": torch.ones(1, length, dtype=torch.long),
                   "response_mask": resp, "prompt_index": torch.zeros(1, dtype=torch.long)})
        b["advantages"] = torch.randn(ids.shape, generator=g)
        return arrange_minibatches(b, 1, 1, "token-mean")

    actor = WorkerGroup(PeakRole, init_kwargs={"cfg": cfg, "role": "actor"}, name=f"long-cp{cp}")
    described = actor.describe()
    actor.measured_update(batch_of(256, 1))  # AdamW's state and the allocator's pools
    measured = actor.measured_update(batch_of(tokens, 2))
    actor.close()
    Path(out_path).write_text(json.dumps({"cp": cp, "describe": described, "ranks": measured}, default=str))


def run_world(cp: int, tokens: int, recompute: str, prompt_share: float, tmp: Path) -> dict[str, Any]:
    from hpcrl.launch import entry_argv, mpiexec_command

    spec, out = tmp / f"spec-cp{cp}.json", tmp / f"out-cp{cp}.json"
    spec.write_text(json.dumps({"cp": cp, "tokens": tokens, "recompute": recompute, "prompt_share": prompt_share}))
    cmd = mpiexec_command(cp, entry_argv(str(Path(__file__).resolve()), ["--child", str(spec), str(out)]))
    steal0, t0 = steal_seconds(), time.time()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0 or not out.is_file():
        print(r.stdout[-3000:], r.stderr[-6000:])
        raise SystemExit(f"bench_long: the CP={cp} world failed (exit {r.returncode})")
    res = json.loads(out.read_text())
    res.update(wall_s=time.time() - t0, steal_s=steal_seconds() - steal0, load=os.getloadavg()[0])
    return res


def plan_rows() -> list[tuple[str, list[str], str]]:
    """The planner runs of the issue (the overrides of tests/test_plan.py): each model and sample
    length at CP=1, then with the CP the plan names."""
    base = ["configs/grpo_tiny.yaml", "trainer.device=cuda", "model.dtype=bf16", "data.max_prompt_length=1024",
            "--gpus-per-node", "8", "--gpu-mem", "80"]
    return [
        ("Qwen2.5-7B, 32k samples, 2 x 8 x 80 GB",
         [*base, "model.path=configs/models/qwen2.5-7b", "--nodes", "2", "rollout.max_new_tokens=31744",
          "actor.parallel.tensor_parallel=4", "rollout.tensor_parallel=4", "actor.micro_batch_tokens=32768"],
         "actor.parallel.context_parallel=2"),
        ("Qwen2.5-32B, 16k samples, 4 x 8 x 80 GB",
         [*base, "--skip-path-checks", "--model-config", "configs/models/qwen2.5-32b", "--nodes", "4",
          "rollout.max_new_tokens=15360", "actor.parallel.tensor_parallel=8", "rollout.tensor_parallel=8",
          "actor.micro_batch_tokens=16384", "actor.offload=true"],
         "actor.parallel.context_parallel=2"),
    ]


def main() -> int:
    """Exit status 1 when a CP's activation memory missed its goal (the table says which), else 0."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="sequence length (SmolLM2 holds 8192 positions)")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="full",
                   help="actor.recompute of every run (default full: CP=1 at 8k tokens fits this machine only so)")
    p.add_argument("--prompt-share", type=float, default=1 / 16,
                   help="the prompt's share of the sequence (no loss there: the output layer runs at the response "
                        "tokens only, so a rank's logits follow how many of them its chunks hold)")
    p.add_argument("--skip-plan", action="store_true")
    p.add_argument("--plan-only", action="store_true")
    args = p.parse_args()
    print(f"[bench_long] load average {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    missed = []  # the CPs whose activation memory is not within 15% of CP=1's / CP
    if not args.plan_only:
        tmp = Path(tempfile.mkdtemp(prefix="hpcrl-bench-long-"))
        results = {}
        for cp in args.cps:
            r = run_world(cp, args.tokens, args.recompute, args.prompt_share, tmp)
            results[cp] = r
            ranks = r["ranks"]
            act = [x["peak_above_start_gb"] - x["grad_gb"] for x in ranks]
            print(f"[bench_long] CP={cp} ({cp} worker(s), {args.tokens // cp} tokens a rank, recompute "
                  f"{args.recompute}): peak above start {max(x['peak_above_start_gb'] for x in ranks):.3f} GB a rank "
                  f"(max), activations (minus {ranks[0]['grad_gb']:.3f} GB of gradients) "
                  f"{', '.join(f'{a:.3f}' for a in act)} GB; resident at start {ranks[0]['start_gb']:.2f} GB; "
                  f"update {max(x['update_s'] for x in ranks):.1f} s; load {r['load']:.2f}, steal {r['steal_s']:.1f} s",
                  flush=True)
        base = max(x["peak_above_start_gb"] - x["grad_gb"] for x in results[args.cps[0]]["ranks"])
        print("\n[bench_long] activation memory per rank (the largest rank, and the mean of the ranks) against "
              "CP=1's / CP (goal: within 15%)")
        for cp, r in results.items():
            acts = [x["peak_above_start_gb"] - x["grad_gb"] for x in r["ranks"]]
            want = base * args.cps[0] / cp
            act, mean = max(acts), sum(acts) / len(acts)
            print(f"  CP={cp}: largest {act:.3f} GB, mean {mean:.3f} GB vs {want:.3f} GB -> {act / want - 1:+.1%} / "
                  f"{mean / want - 1:+.1%} ({'met' if abs(act / want - 1) <= 0.15 else 'NOT met'})")
            if abs(act / want - 1) > 0.15:
                missed.append(cp)
    if not args.skip_plan:
        plan_table()
    if missed:
        print(f"\n[bench_long] goal NOT met at CP={', '.join(map(str, missed))}: exit 1", flush=True)
        return 1
    return 0


def plan_table() -> None:
    """hpcrl plan's rows for the long-sequence recipes, each at CP=1 and with CP."""
    for label, argv, with_cp in plan_rows():
        for extra in ([], [with_cp]):
            cmd = [str(REPO / ".venv" / "bin" / "hpcrl"), "plan", *argv, *extra]
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            lines = [ln for ln in r.stdout.splitlines()
                     if ln.startswith(("actor ", "activations", "peak", "verdict", "  - ", "what to change"))]
            print(f"\n[bench_long] {label}{', ' + with_cp if extra else ', CP=1'}: exit {r.returncode}\n  "
                  + "\n  ".join(lines) + (r.stderr[-800:] if r.returncode not in (0, 3) else ""))


if __name__ == "__main__":
    sys.exit(main())
