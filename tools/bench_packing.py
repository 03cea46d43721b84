"""Packed vs padded micro-batches in the Megatron actor update, side by side in one run.

One rank (TP=PP=1), SmolLM2-135M-Instruct in fp32 on CPU, a batch with a realistic length spread
(long-tailed: most responses short, a few long). Same sequences, same loss, same number of
optimizer steps; only the micro-batching differs. Prints tokens/s of both and the ratio.

    .venv/bin/mpiexec -n 1 .venv/bin/python tools/bench_packing.py [--model models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import warnings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.set_num_threads(os.cpu_count() or 1)
    from hpcrl.algos.losses import ppo_policy_loss, token_weights
    from hpcrl.engines.megatron.engine import EngineOptions, MegatronEngine, OptimSettings, init_model_parallel

    init_model_parallel(1, 1)
    g = torch.Generator().manual_seed(0)
    # long-tailed lengths: exponential with mean max_len/5, clipped to [16, max_len]
    lengths = [int(min(max(16, torch.empty(1).exponential_(5.0 / args.max_len, generator=g).item()), args.max_len))
               for _ in range(args.seqs)]
    results = {}
    for packing in (False, True):
        eng = MegatronEngine(args.model, EngineOptions(micro_batch_tokens=args.token_budget, packing=packing,
                                                       micro_batch_size=args.micro_batch_size),
                             optim=OptimSettings(lr=1e-6))
        seqs = [torch.randint(0, eng.arch.vocab_size, (n,), generator=torch.Generator().manual_seed(i))
                for i, n in enumerate(lengths)]
        masks = [torch.ones(n - 1) for n in lengths]
        fields = {"w": token_weights(masks, "token-mean"), "adv": [torch.ones(n - 1) for n in lengths]}

        def loss_fn(lp, ent, f):
            pg, _ = ppo_policy_loss(lp, lp.detach(), f["adv"])
            return (f["w"] * pg).sum(), {}

        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.train_step(seqs, fields, loss_fn)
        dt = (time.perf_counter() - t0) / args.steps
        n_mb = len(eng._micro_batches(seqs))
        results[packing] = sum(lengths) / dt
        print(f"{'packed' if packing else 'padded'}: {n_mb} micro-batches, {dt:.2f} s/step, "
              f"{results[packing]:.0f} real tokens/s", flush=True)
        del eng
    print(f"lengths: {len(lengths)} sequences, mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)}: "
          f"the padded layout computes {len(lengths) * max(lengths)} token positions for {sum(lengths)} real tokens")
    print(f"packed/padded update throughput: {results[True] / results[False]:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
