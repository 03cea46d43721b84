"""One rollout pool worker (`hpcrl pool RUN_DIR`, run by each task of `hpcrl submit --join`): join the
run, build a vLLM engine from the run's own config, load the weights it is sent, serve segments.

Exit status: 0 when the run ends (or closes the connection), 2 when it cannot join (no running run, a
refused token or fingerprint, a config pools cannot serve), 1 on any other failure. Killed (scancel, a
time limit, preemption), it simply stops: the controller sees the connection close and gives its share
of the segment in flight to the other engines.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpcrl.pools.wire import Channel, NotJoinable, connect, find_controller, fingerprint

EXIT_NOT_JOINABLE = 2
# a pool worker's rank in HPCRL_FAULT (hpcrl.launch.faults): -1 - its index in the pool
POOL_FAULT_RANK_BASE = -1


def _say(who: str, text: str) -> None:
    print(f"[hpcrl pool {who}] {text}", flush=True)


def pool_config(run_dir: Path, overrides: list[str]) -> Any:
    """The run's own resolved config (RUN_DIR/config.yaml) with the pool's overrides; NotJoinable when
    pools cannot serve it."""
    from hpcrl.config.derived import is_split, rollout_mode
    from hpcrl.config.loader import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise NotJoinable(f"{path} is absent: is {run_dir} a run directory?")
    cfg = load_config(path, overrides)
    if not is_split(cfg) or rollout_mode(cfg) != "fully_async":
        raise NotJoinable("rollout pools join runs with trainer.placement=split and rollout.mode=fully_async; "
                          f"{run_dir} runs placement {cfg.trainer.placement}, rollout.mode {rollout_mode(cfg)}")
    if int(cfg.rollout.tensor_parallel) != 1:
        raise NotJoinable(f"a rollout pool worker runs one engine at rollout TP 1; this run has "
                          f"rollout.tensor_parallel={cfg.rollout.tensor_parallel}")
    return cfg


def serve(run_dir: str, overrides: list[str] | None = None, pool: str | None = None,
          index: int | None = None) -> int:
    """Join the run in `run_dir` and serve it until it ends; the exit status (module docstring)."""
    from omegaconf import OmegaConf

    pool = pool or os.environ.get("SLURM_JOB_ID") or f"{socket.gethostname()}-{os.getpid()}"
    index = int(os.environ.get("SLURM_PROCID", "0")) if index is None else index
    who = f"{pool}/{index}"
    t0 = time.monotonic()
    # with the unix time: tools/bench_pools.py tells them from the Slurm job's start (sacct)
    def since() -> str:
        return f"{time.monotonic() - t0:.1f} s after the start (unix {time.time():.2f})"
    try:
        info = find_controller(run_dir)
        cfg = pool_config(Path(run_dir), list(overrides or []))
        sock = connect(info, timeout_s=30.0)
    except NotJoinable as e:
        print(f"hpcrl pool: {e}", file=sys.stderr)
        return EXIT_NOT_JOINABLE
    liveness = float(info.get("liveness_s") or cfg.rollout.pool_liveness_s)
    channel = Channel(sock, liveness)
    channel.send({"type": "hello", "token": info["token"], "pool": pool, "index": index,
                  "host": socket.gethostname(), "pid": os.getpid(), "fingerprint": fingerprint(cfg)})
    try:
        answer = channel.recv(30.0)
    except (TimeoutError, ConnectionError, OSError) as e:
        print(f"hpcrl pool: the run's controller did not answer the hello ({e})", file=sys.stderr)
        return EXIT_NOT_JOINABLE
    if answer["type"] != "welcome":
        print(f"hpcrl pool: the run refused this pool: {answer.get('reason', answer)}", file=sys.stderr)
        return EXIT_NOT_JOINABLE
    member = str(answer["member"])
    _say(who, f"joined the run in {run_dir} as {member}; building the engine")
    store_host = sock.getpeername()[0]  # the controller's store, as this worker reached the controller
    # alive from here on, also while the engine builds (minutes on a busy node)
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(channel, liveness / 4, stop), daemon=True).start()
    engine = None
    try:
        engine = _build_engine(OmegaConf.to_container(cfg, resolve=True))
        channel.send({"type": "ready", "engine_s": time.monotonic() - t0})
        _say(who, f"engine ready {since()}; waiting for the weights")
        return _serve_loop(who, channel, engine, store_host, liveness, index, since)
    finally:
        stop.set()
        channel.close()
        if engine is not None:
            engine.close(final=True)  # the pool worker exits after this


def _build_engine(plain: dict[str, Any]) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    from hpcrl.launch.rendezvous import default_backend
    from hpcrl.workers.actor_rollout import build_rollout_engine, read_rollout_arch
    from hpcrl.workers.role_engines import resolve_dtype

    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("SLURM_LOCALID", "0")) % torch.cuda.device_count())
    # vLLM's external launcher builds on a torch.distributed world: this worker's own, of one rank
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    path = plain["model"]["path"]
    return build_rollout_engine(plain, path, read_rollout_arch(plain, path), resolve_dtype(plain["model"]["dtype"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _heartbeat(channel: Channel, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        try:
            channel.send({"type": "heartbeat"})
        except OSError:
            return


def _serve_loop(who: str, channel: Channel, engine: Any, store_host: str, liveness: float, index: int,
                since: Any) -> int:
    from hpcrl.engines.transfer import receive_from_trainer
    from hpcrl.engines.vllm.engine import SamplingSettings
    from hpcrl.launch.faults import FaultInjector
    from hpcrl.pools.weights import HeaderChannel, open_link

    faults = FaultInjector(POOL_FAULT_RANK_BASE - index)
    link = None
    segments = tokens = served = 0
    while True:
        try:
            msg = channel.recv(max(4 * liveness, 300.0))
        except TimeoutError:
            _say(who, f"nothing from the run's controller for {max(4 * liveness, 300.0):.0f} s: leaving")
            return 1
        except (ConnectionError, OSError):
            _say(who, "the run's controller closed the connection (the run ended or was stopped): leaving")
            return 0
        kind = msg["type"]
        if kind == "weights":
            if link is None:
                link = open_link([store_host, msg["store"][1]], msg["key"], 1, float(msg["timeout_s"]))
            stats = receive_from_trainer(engine, HeaderChannel(link), link)
            channel.send({"type": "loaded", "version": msg["version"], "seconds": stats.seconds,
                          "bytes": stats.bytes_received})
            _say(who, f"weights after step {msg['version']} loaded: {stats.bytes_received / 1e6:.1f} MB in "
                      f"{stats.seconds:.2f} s ({segments} segment(s), {tokens} token(s) generated before)")
            segments = tokens = 0
        elif kind == "generate":
            faults.maybe_kill_self("pool_segment")
            requests = msg["requests"]
            sampling = SamplingSettings(**msg["sampling"])
            out = engine.generate_each([r[0] for r in requests], sampling, [r[1] for r in requests],
                                       [r[2] for r in requests])
            channel.send({"type": "completions", "seq": msg["seq"],
                          "items": [[c.token_ids, c.logprobs, c.finish_reason] for c in out]})
            if not served:
                _say(who, f"first segment served {since()}")
            served += 1
            segments += 1
            tokens += sum(len(c.token_ids) for c in out)
        elif kind == "stop":
            _say(who, f"the run let this pool go: {msg.get('reason', '')}")
            return 0
