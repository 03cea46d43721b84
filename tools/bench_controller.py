"""Benchmark the hpcrl controller runtime against Ray actors, side by side, on this machine.

    .venv/bin/python tools/bench_controller.py --ray-python /tmp/rayvenv/bin/python

Measures, with 1 driver + 4 workers in both systems:
  * no-op call latency (one call on every worker, wait for all replies);
  * scatter: a 64 MB float32 array split in 4 shards, one per worker;
  * gather: 4 x 16 MB shards held by the workers, concatenated on the driver;
  * round trip: scatter + echo back + concatenate, checked bit-identical.
hpcrl runs under mpiexec (rank 0 = driver); Ray runs in the interpreter given by
--ray-python (a separate venv keeps Ray out of the project's environment). Not run by CI.
Top-level imports are stdlib only: the Ray child does not have torch or hpcrl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timeit(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _summary(samples: list[float], nbytes: int = 0) -> dict:
    med = statistics.median(samples)
    res = {"median_s": med, "mean_s": statistics.fmean(samples), "min_s": min(samples), "n": len(samples)}
    if nbytes:
        res["gb_per_s"] = nbytes / med / 1e9
    return res


# ---------------------------------------------------------------- hpcrl (rank 0 of an MPI world)
if __name__ == "__hpcrl_program__":  # loaded by launchers/hpcrl_entry.py on every rank, never by Ray
    import torch

    from hpcrl.controller import Batch, Collect, Dispatch, Worker, WorkerGroup, register

    class BenchWorker(Worker):
        def __init__(self) -> None:
            self.held: torch.Tensor | None = None

        def noop(self) -> None:
            return None

        @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.RANK0)
        def consume(self, batch: Batch) -> int:
            self.held = batch["x"]
            return batch["x"].numel()

        @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.DP)
        def produce(self) -> Batch:
            return Batch({"x": self.held})

        @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
        def echo(self, batch: Batch) -> Batch:
            return batch


def hpcrl_main() -> None:
    """Controller program: `launchers/hpcrl_entry.py tools/bench_controller.py:hpcrl_main JSON`."""
    import hashlib

    args = json.loads(sys.argv[1])
    g = WorkerGroup(BenchWorker)
    nbytes = args["mb"] * 2**20
    x = torch.randn(nbytes // 4)
    batch = Batch({"x": x})
    res = {"workers": g.size}
    res["noop"] = _summary(_timeit(g.noop, args["iters"], 50))
    res["scatter"] = _summary(_timeit(lambda: g.consume(batch), args["bulk_iters"], 2), nbytes)
    res["gather"] = _summary(_timeit(g.produce, args["bulk_iters"], 2), nbytes)
    res["roundtrip"] = _summary(_timeit(lambda: g.echo(batch), args["bulk_iters"], 2), nbytes)
    back = g.echo(batch)["x"]
    digest = lambda t: hashlib.sha256(t.numpy().tobytes()).hexdigest()
    res["bit_identical"] = digest(back) == digest(x)
    t = time.perf_counter()
    futs = [g.noop.future() for _ in range(args["iters"])]
    for f in futs:
        f.result()
    res["noop_pipelined_us"] = (time.perf_counter() - t) / len(futs) * 1e6
    with open(args["out"], "w") as f:
        json.dump(res, f)


# ---------------------------------------------------------------- Ray (separate interpreter)
def ray_child(args: dict) -> dict:
    import numpy as np
    import ray

    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    @ray.remote
    class RayWorker:
        def __init__(self) -> None:
            self.held = None

        def noop(self) -> None:
            return None

        def consume(self, x: np.ndarray) -> int:
            self.held = x  # zero-copy, read-only view of the object store: Ray's best case
            return x.size

        def produce(self) -> np.ndarray:
            return self.held

        def echo(self, x: np.ndarray) -> np.ndarray:
            return x

    actors = [RayWorker.remote() for _ in range(args["workers"])]
    ray.get([a.noop.remote() for a in actors])
    nbytes = args["mb"] * 2**20
    x = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    shards = np.array_split(x, len(actors))

    def scatter() -> None:
        ray.get([a.consume.remote(s) for a, s in zip(actors, shards, strict=True)])

    def gather() -> np.ndarray:
        return np.concatenate(ray.get([a.produce.remote() for a in actors]))

    def roundtrip() -> np.ndarray:
        return np.concatenate(ray.get([a.echo.remote(s) for a, s in zip(actors, shards, strict=True)]))

    res = {"workers": len(actors), "ray_version": ray.__version__}
    res["noop"] = _summary(_timeit(lambda: ray.get([a.noop.remote() for a in actors]), args["iters"], 50))
    res["scatter"] = _summary(_timeit(scatter, args["bulk_iters"], 2), nbytes)
    res["gather"] = _summary(_timeit(gather, args["bulk_iters"], 2), nbytes)
    res["roundtrip"] = _summary(_timeit(roundtrip, args["bulk_iters"], 2), nbytes)
    res["bit_identical"] = bool(np.array_equal(roundtrip().view(np.uint32), x.view(np.uint32)))
    t = time.perf_counter()
    ray.get([a.noop.remote() for _ in range(args["iters"]) for a in actors])
    res["noop_pipelined_us"] = (time.perf_counter() - t) / args["iters"] * 1e6
    ray.shutdown()
    return res


# ---------------------------------------------------------------- driver: run both, print side by side
def _run_hpcrl(args: argparse.Namespace, out: str) -> dict:
    sys.path.insert(0, REPO)
    from hpcrl.launch import entry_argv, mpiexec_command

    payload = json.dumps({"mb": args.mb, "iters": args.iters, "bulk_iters": args.bulk_iters, "out": out})
    cmd = mpiexec_command(args.workers, entry_argv(f"{os.path.abspath(__file__)}:hpcrl_main", [payload],
                                                   python=args.python))
    subprocess.run(cmd, check=True, timeout=600, env={**os.environ, "HPCRL_TORCH_DIST": "0"})
    with open(out) as f:
        return json.load(f)


def _run_ray(args: argparse.Namespace, out: str) -> dict:
    payload = json.dumps({"mb": args.mb, "iters": args.iters, "bulk_iters": args.bulk_iters,
                          "workers": args.workers, "out": out})
    subprocess.run([args.ray_python, os.path.abspath(__file__), "--ray-child", payload], check=True, timeout=900)
    with open(out) as f:
        return json.load(f)


def _report(h: dict, r: dict, mb: int) -> None:
    print(f"\n{'':28}{'hpcrl':>14}{'ray ' + r['ray_version']:>16}{'ratio':>12}")
    us = lambda d: d["median_s"] * 1e6
    print(f"{'no-op call, 4 workers (us)':28}{us(h['noop']):14.1f}{us(r['noop']):16.1f}"
          f"{us(r['noop']) / us(h['noop']):11.1f}x  (ray/hpcrl latency)")
    print(f"{'  pipelined, per call (us)':28}{h['noop_pipelined_us']:14.1f}{r['noop_pipelined_us']:16.1f}"
          f"{r['noop_pipelined_us'] / h['noop_pipelined_us']:11.1f}x")
    for key, label in (("scatter", f"scatter {mb} MB (GB/s)"), ("gather", f"gather {mb} MB (GB/s)"),
                       ("roundtrip", f"scatter+gather {mb} MB (GB/s)")):
        print(f"{label:28}{h[key]['gb_per_s']:14.2f}{r[key]['gb_per_s']:16.2f}"
              f"{h[key]['gb_per_s'] / r[key]['gb_per_s']:11.2f}x  (hpcrl/ray throughput)")
    print(f"{'bit-identical round trip':28}{h['bit_identical']!s:>14}{r['bit_identical']!s:>16}")
    print("\nmedians; latency ratio > 1 and throughput ratio > 1 favour hpcrl.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ray-python", default=os.environ.get("RAY_PYTHON", "/tmp/rayvenv/bin/python"))
    p.add_argument("--python", default=sys.executable, help="interpreter of the hpcrl run")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--bulk-iters", type=int, default=10)
    p.add_argument("--ray-child", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ray_child:
        child = json.loads(args.ray_child)
        res = ray_child(child)
        with open(child["out"], "w") as f:
            json.dump(res, f)
        return
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        h = _run_hpcrl(args, os.path.join(tmp, "hpcrl.json"))
        print(f"hpcrl run: {time.time() - t:.1f} s wall (incl. startup)")
        t = time.time()
        try:
            r = _run_ray(args, os.path.join(tmp, "ray.json"))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"ray run failed ({e}); hpcrl alone:\n{json.dumps(h, indent=1)}")
            sys.exit(1)
        print(f"ray run: {time.time() - t:.1f} s wall (incl. startup)")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"{args.workers} workers + 1 driver")
    _report(h, r, args.mb)


if __name__ == "__main__":
    main()
