"""Single-controller runtime, tested in real MPI worlds of 1 controller + 4 workers.

One world (tests/programs/ctrl_scenarios.py) runs every dispatch/collect scenario and
writes what it saw to JSON; each test below asserts on its part. The failure tests start
their own short worlds (tests/programs/ctrl_kill.py) with a 4 s heartbeat bound. The Slurm
test submits a two-component hetjob and starts the same kind of world with srun.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcrl.controller import Batch, Collect, Dispatch, ParallelLayout, Worker, register
from hpcrl.controller.dispatch import dp_split, merge, method_mode
from hpcrl.launch import entry_argv, mpiexec_command, srun_het_command
from hpcrl.launch.commands import srun_env
from hpcrl.launch.exit_order import hydra_announces_exits, plan_exit

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = REPO / "tests" / "programs"
HOST = socket.gethostname()
BOUND_S = 4.0  # heartbeat timeout used by the failure worlds
SLACK_S = 3.0


def _run_world(tmp: Path, program: str, args: list[str], env: dict[str, str], timeout: float
               ) -> subprocess.CompletedProcess:
    """Run one 1 + 4 rank world with the default single-machine launch route; never hangs.

    The ranks' stderr files (hpcrl/controller/stderr_log.py) go to `tmp/logs` unless `env` says.
    """
    cmd = mpiexec_command(4, entry_argv(str(PROGRAMS / program), args))
    env = {"HPCRL_LOG_DIR": str(tmp / "logs"), **env}
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the world we started, and only it
        out, err = proc.communicate()
        pytest.fail(f"world did not finish in {timeout} s:\n{err[-3000:]}")
    (tmp / "stdout.txt").write_text(out)
    (tmp / "stderr.txt").write_text(err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _alive(pid: int) -> bool:
    """True if `pid` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read() and _alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _assert_all_gone(pids: list[int], token: str, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (any(_alive(p) for p in pids) or _processes_with(token)):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "ranks left behind"
    assert not _processes_with(token), "processes of this world left behind"


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ctrl_world")
    out = tmp / "scenarios.json"
    t0 = time.monotonic()
    res = _run_world(tmp, "ctrl_scenarios.py", [str(out)],
                     {"HPCRL_HEARTBEAT_TIMEOUT": "3", "HPCRL_HEARTBEAT_INTERVAL": "0.5"}, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    data = json.loads(out.read_text())
    data["_wall_s"] = time.monotonic() - t0
    data["_token"] = str(out)
    data["_output"] = res.stdout + res.stderr
    return data


# ---------------------------------------------------------------- in-process units (no MPI)
def test_batch_split_concat_reorder() -> None:
    b = Batch({"x": torch.arange(10), "m": torch.ones(10, 3)}, {"s": [str(i) for i in range(10)]}, {"k": 1})
    parts = b.chunk(4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["s"] == b["s"] and back.meta == {"k": 1}
    assert back["x"] is not b["x"]  # a concat of user views copies, never aliases
    perm = torch.randperm(10)
    shuffled = b.select(perm)
    assert shuffled["s"] == [str(i) for i in perm.tolist()]
    restored = shuffled.reorder(torch.argsort(perm))
    assert torch.equal(restored["m"], b["m"]) and restored["s"] == b["s"]
    assert [len(p) for p in b.split([1, 9])] == [1, 9]
    with pytest.raises(ValueError):
        Batch({"x": torch.zeros(3)}, {"s": ["a"]})


def test_layout_and_dispatch_helpers() -> None:
    lay = ParallelLayout.megatron(tp=2, pp=2, dp=2)
    assert lay.coords[:4] == ((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0))  # TP fastest, then DP, then PP
    assert lay.output_ranks() == [4, 6]  # TP rank 0 of the last stage, in DP order
    shards = dp_split((Batch({"x": torch.arange(5)}), 7), {"t": torch.arange(5)}, 2)
    assert [s[0][0]["x"].tolist() for s in shards] == [[0, 1, 2], [3, 4]]
    assert [s[0][1] for s in shards] == [7, 7] and shards[1][1]["t"].tolist() == [3, 4]
    assert merge([(torch.ones(1), "a"), (torch.zeros(1), "b")])[1] == ["a", "b"]

    class W(Worker):
        @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP)
        def f(self) -> None:
            return None

        def g(self) -> None:
            return None

    assert method_mode(W, "f").dispatch is Dispatch.DP_SPLIT
    assert method_mode(W, "g").collect is Collect.ALL
    assert W().group_rank == 0  # constructible outside the runtime


# ---------------------------------------------------------------- one world, every scenario
def test_world_and_torch_distributed(scenarios: dict[str, Any]) -> None:
    who = scenarios["whoami"]
    assert [w["mpi_rank"] for w in who] == [1, 2, 3, 4]
    assert [w["worker_rank"] for w in who] == [0, 1, 2, 3]
    assert [w["local_rank"] for w in who] == [0, 1, 2, 3]
    assert all(w["host"] == HOST for w in who)
    for i, g in enumerate(scenarios["gloo"]):
        assert g["sum"] == 6.0 and g["backend"] == "gloo"
        assert g["env"]["RANK"] == str(i) and g["env"]["WORLD_SIZE"] == "4" and g["env"]["LOCAL_RANK"] == str(i)
        assert g["env"]["MASTER_ADDR"] and g["env"]["MASTER_PORT"] == scenarios["gloo"][0]["env"]["MASTER_PORT"]


def test_one_to_all_per_rank_rank0(scenarios: dict[str, Any]) -> None:
    assert scenarios["one_to_all"] == [[r, [0.0, 3.0, 6.0, 9.0], "hi"] for r in range(4)]
    assert scenarios["per_rank"] == [[0, 10, "a"], [1, 11, "b"], [2, 12, "c"], [3, 13, "d"]]
    assert scenarios["rank0"] == 0
    assert scenarios["store_returns"] is None  # Collect.NONE


def test_dp_split_collect_in_order(scenarios: dict[str, Any]) -> None:
    d = scenarios["dp_split"]
    assert d["x"] == [float(i) for i in range(10)]
    assert d["group_rank"] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]  # even split, DP order kept
    assert d["doubled"] == [2.0 * i for i in range(10)]
    assert d["who"] == [f"{r}:s{i}" for i, r in enumerate(d["group_rank"])]
    assert scenarios["dp_split_meta"] == {"temp": 0.7}


def test_dp_with_tp_and_pp_layouts(scenarios: dict[str, Any]) -> None:
    # TP=2 x DP=2 (megatron order): shard d goes to ranks (2d, 2d+1); results come from TP rank 0.
    tp = scenarios["tp2dp2"]
    assert tp["x"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert tp["group_rank"] == [0, 0, 0, 2, 2, 2] and tp["dp_rank"] == [0, 0, 0, 1, 1, 1]
    # PP=2 x DP=2: results come from the last stage (group ranks 2 and 3).
    pp = scenarios["pp2dp2"]
    assert pp["group_rank"] == [2, 2, 2, 3, 3, 3] and pp["dp_rank"] == [0, 0, 0, 1, 1, 1]
    # Coordinates reported by the workers themselves, in a non-megatron order.
    assert scenarios["reported_layout"] == [[1, 1, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0]]
    assert scenarios["reported_rows"] == [[0.0, 3.0], [1.0, 3.0], [2.0, 1.0], [3.0, 1.0]]


def test_64mb_roundtrip_bit_identical(scenarios: dict[str, Any]) -> None:
    assert scenarios["big_bytes"] == 64 * 2**20
    assert scenarios["big_back_digest"] == scenarios["big_digest"]
    assert scenarios["big_back_dtype"] == "torch.int32"
    assert scenarios["shard_digests"] == scenarios["expected_shard_digests"]  # each worker got its slice
    assert scenarios["fetch_digest"] == scenarios["big_digest"]


def test_tensors_travel_as_raw_buffers_not_pickles() -> None:
    """What the round trip above relies on: the 64 MB tensor leaves the pickled header (a few hundred
    bytes) and goes as one raw buffer that is the tensor's own memory (no copy on the way out)."""
    from hpcrl.controller.codec import allocate, decode, encode
    from hpcrl.controller.transport import dumps

    big = torch.randint(0, 2**31 - 1, (16, 2**20), dtype=torch.int32)  # 16 rows of 4 MB
    enc = encode(Batch({"x": big}, {"names": ["a"] * 16}))
    assert len(dumps((enc.skeleton, enc.specs))) < 1024
    assert enc.nbytes == 64 * 2**20 and len(enc.buffers) == 1
    assert enc.buffers[0].ctypes.data == big.data_ptr()
    objs, views = allocate(enc.specs)
    for view, buf in zip(views, enc.buffers, strict=True):
        view[:] = buf
    back = decode(enc.skeleton, objs)
    assert torch.equal(back["x"], big) and back.non_tensors["names"] == ["a"] * 16


def test_colocated_groups_share_processes(scenarios: dict[str, Any]) -> None:
    assert [w["tag"] for w in scenarios["colocated"]] == ["b"] * 4
    assert [w["pid"] for w in scenarios["colocated"]] == [w["pid"] for w in scenarios["whoami"]]
    assert {w["group"] for w in scenarios["colocated"]} == {"critic"}


def test_closed_group_is_freed_on_its_ranks(scenarios: dict[str, Any]) -> None:
    assert [h["alive"] for h in scenarios["holders_before_close"]] == [1, 1, 0, 0]
    assert scenarios["holders_after_close"] == [{"alive": 0, "closed": ["held"]}] * 2 + [
        {"alive": 0, "closed": []}] * 2
    assert "was closed" in scenarios["call_after_close"] and "held" in scenarios["call_after_close"]
    assert scenarios["same_name_again"] == ["held"]


def test_a_rank_left_without_roles_sets_its_own_objects_aside_and_still_frees_later_ones(
        scenarios: dict[str, Any]) -> None:
    """Once its last role is dropped, a worker freezes what is alive (its imports, the runtime: gc.freeze), so
    that a later drop's full collection walks only what was built since (0.25 s a drop with the engines'
    modules loaded); a role built after that is still freed when dropped (its cycle collected)."""
    frozen = scenarios["frozen"]
    assert frozen["before"] == [0, 0, 0, 0], frozen  # nothing set aside while roles were alive
    assert all(n > 10_000 for n in frozen["after_last_drop"]), frozen  # torch's modules and the runtime
    later = scenarios["holders_later"]
    assert [h["alive"] for h in later["before_close"]] == [1, 1, 0, 0], later
    assert [h["alive"] for h in later["after_close"]] == [0, 0, 0, 0], later
    assert [h["closed"][-1:] for h in later["after_close"]] == [["held-after-the-freeze"]] * 2 + [[]] * 2, later


def test_futures_overlap_and_timeout(scenarios: dict[str, Any]) -> None:
    assert scenarios["future_done_early"] is False
    assert 1.0 <= scenarios["overlap_elapsed_s"] < 1.8  # two 1 s calls on disjoint ranks ran together
    assert "not done after 0.05 s" in scenarios["timeout"]
    assert scenarios["after_timeout"] == 0


def test_remote_exception_carries_traceback(scenarios: dict[str, Any]) -> None:
    err = scenarios["remote_error"]
    assert err is not None
    assert "fail_deliberately" in err["traceback"] and "ValueError: kaboom" in err["traceback"]
    assert f"host {HOST}" in err["message"] and f"rank {err['rank']}" in err["message"]
    assert "ctrl_scenarios.py" in err["message"]  # the remote traceback is in the message itself
    assert err["host"] == HOST and err["rank"] in (1, 2, 3, 4)
    assert scenarios["after_error"] == 0  # the workers keep serving
    assert "broken.__init__" in scenarios["init_error"] and "constructor refused" in scenarios["init_error"]


def test_long_computation_is_not_a_death(scenarios: dict[str, Any]) -> None:
    assert scenarios["long_spin_s"] > scenarios["heartbeat_timeout_s"] + 1
    assert len(scenarios["long_spin_iters"]) == 4


def test_clean_shutdown_leaves_nothing(scenarios: dict[str, Any]) -> None:
    pids = [scenarios["controller_pid"], *(w["pid"] for w in scenarios["whoami"])]
    _assert_all_gone(pids, scenarios["_token"])


def test_clean_shutdown_is_quiet(scenarios: dict[str, Any]) -> None:
    # mpiexec exited 0 (asserted by the fixture); no heartbeat was left unreceived at MPI_Finalize
    # (UCX warns about each one) and every rank's exit turn was confirmed by hydra's notices.
    assert "was not matched" not in scenarios["_output"]
    assert "exit turn not confirmed" not in scenarios["_output"]


def test_exit_order_plan() -> None:
    hosts, proxies = ["h"] * 4, [100, 101, 102, 103]
    # workers leave by rank, the controller last; each waits for the proxy of the rank before it
    assert [plan_exit(r, hosts, proxies, [True] * 4) for r in range(4)] == [(3, 103), (0, None), (1, 101), (2, 102)]
    assert plan_exit(1, hosts, proxies, [True, True, False, True]) is None  # hydra does not announce exits
    assert plan_exit(1, ["h", "h", "g", "h"], proxies, [True] * 4) is None  # proxies on other hosts
    assert plan_exit(1, hosts, [100, 100, 102, 103], [True] * 4) is None  # several ranks per proxy
    assert not hydra_announces_exits()  # pytest is not started by hydra


# ---------------------------------------------------------------- failures
@pytest.mark.world
def test_sigkill_worker_fails_controller_within_bound(tmp_path: Path) -> None:
    out = tmp_path / "kill_worker.json"
    res = _run_world(tmp_path, "ctrl_kill.py", [str(out), "worker"],
                     {"HPCRL_HEARTBEAT_TIMEOUT": str(BOUND_S), "HPCRL_HEARTBEAT_INTERVAL": "0.5"}, timeout=120)
    data = json.loads(out.read_text())
    assert res.returncode != 0
    assert data["error_rank"] == 2, res.stderr[-3000:]
    victim = next(w for w in data["workers"] if w["mpi_rank"] == 2)
    assert f"rank 2 (host {HOST}" in data["error"] and f"pid {victim['pid']}" in data["error"]
    assert data["error_at"] - data["killed_at"] < BOUND_S + SLACK_S
    assert "worker rank 2" in res.stderr and "is lost" in res.stderr
    _assert_all_gone([data["controller_pid"], *(w["pid"] for w in data["workers"])], str(out))


@pytest.mark.world
def test_sigkill_controller_makes_workers_exit(tmp_path: Path) -> None:
    out = tmp_path / "kill_controller.json"
    t0 = time.time()
    res = _run_world(tmp_path, "ctrl_kill.py", [str(out), "controller"],
                     {"HPCRL_HEARTBEAT_TIMEOUT": str(BOUND_S), "HPCRL_HEARTBEAT_INTERVAL": "0.5"}, timeout=120)
    data = json.loads(out.read_text())
    assert res.returncode != 0
    assert time.time() - data["killed_at"] < BOUND_S + SLACK_S + 5, f"took {time.time() - t0:.1f} s"
    # The workers end either through their heartbeat check ("controller ... silent") or because
    # the launcher tears the job down once the controller's process is gone; both are fine.
    _assert_all_gone([w["pid"] for w in data["workers"]], str(out))


@pytest.mark.world
def test_cxx_death_in_a_collective_is_named_first(tmp_path: Path) -> None:
    """Rank 3 throws a C++ exception nothing catches (std::terminate, SIGABRT) while ranks 1, 2, 4
    wait for it in a gloo all_reduce. The peers' `Connection closed by peer` errors reach the
    controller first; the error must still name rank 3, with its own stderr, and list the peers
    after it as consequences."""
    out, logs = tmp_path / "cxx.json", tmp_path / "logs"
    # a quiet terminal, as `hpcrl run` gives: the death must still reach it, the rank named
    res = _run_world(tmp_path, "ctrl_kill.py", [str(out), "cxx"],
                     {"HPCRL_HEARTBEAT_TIMEOUT": str(BOUND_S), "HPCRL_HEARTBEAT_INTERVAL": "0.5",
                      "HPCRL_TERMINAL": "quiet"}, timeout=120)
    data = json.loads(out.read_text())
    assert res.returncode != 0
    error, failures = data["error"], data["failures"]
    victim = next(w for w in data["workers"] if w["mpi_rank"] == 3)
    assert (data["error_type"], data["error_rank"]) == ("WorkerDiedError", 3), error
    head = error.splitlines()[0]
    assert f"worker rank 3 (host {HOST}, pid {victim['pid']}) is lost: its process died" in head
    assert "SIGABRT after C++ std::terminate: uncaught std::runtime_error: hpcrl-test: this rank dies" in head
    # its last words, quoted from its stderr file: libstdc++'s text and faulthandler's stack
    assert "terminate called after throwing an instance of 'std::runtime_error'" in error
    assert "Fatal Python error: Aborted" in error and "in reduce_then_die" in error
    # the peers: each either failed as a consequence or is still inside the collective
    assert failures[0] == {"rank": 3, "kind": "died", "consequence": False}
    assert sorted(f["rank"] for f in failures) == [1, 2, 3, 4]
    assert all(f["consequence"] or f["kind"] == "no reply" for f in failures[1:]), failures
    consequences = [f["rank"] for f in failures if f["consequence"]]
    assert consequences, failures
    listed = error.split("\nconsequences (", 1)[1]
    for r in consequences:
        assert f"rank {r} (host {HOST}" in listed and "Connection closed by peer" in listed
    assert data["error_at"] - data["started_at"] < 0.5 + 1.0 + SLACK_S  # death delay + grace, not the bound
    # the quiet terminal shows the death, each line naming the rank; the file outlived the rank
    assert re.search(r"^\[rank 3 \S+\] terminate called after throwing an instance of 'std::runtime_error'",
                     res.stderr, re.M), res.stderr[-3000:]
    (log,) = logs.glob("rank3.*.log")
    assert "what():  hpcrl-test: this rank dies inside C++" in log.read_text()
    _assert_all_gone([data["controller_pid"], *(w["pid"] for w in data["workers"])], str(out))
    _assert_all_gone([], str(logs))  # the stderr copiers ended with their ranks


def test_failures_are_ordered_cause_first() -> None:
    """The classification on texts as libraries print them (gloo, libstdc++, faulthandler, glibc)."""
    from hpcrl.controller import RankFailure, postmortem
    from hpcrl.controller.stderr_log import StderrSection

    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
            "by peer [127.0.0.1]:38579. This is typically caused by a remote worker crashing.")
    assert postmortem.is_consequence(gloo)
    assert postmortem.is_consequence("DistBackendError: NCCL error: remote process exited or there was a network error")
    assert not postmortem.is_consequence("ValueError: kaboom from group rank 2")
    enforce = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
               "../third_party/gloo/gloo/transport/tcp/pair.cc:446] Read error [10.0.0.7]:4711: Connection reset "
               "by peer\nFatal Python error: Aborted\n\nCurrent thread 0x01 (most recent call first):\n"
               "  File \"x.py\", line 1")
    what, consequence = postmortem.describe_death(enforce)
    assert what.startswith("SIGABRT after C++ std::terminate: uncaught gloo::EnforceNotMet: [enforce fail")
    assert consequence  # it died of a peer's death
    assert postmortem.describe_death("Fatal Python error: Segmentation fault\n\nThread 0x1")[0].startswith("SIGSEGV")
    glibc = postmortem.describe_death("double free or corruption (out)\n")[0]
    assert glibc == "SIGABRT after double free or corruption (out)"
    assert "SIGKILL" in postmortem.describe_death("")[0]
    t = 1000.0
    killed = postmortem.died(4, "rank 4", StderrSection("f", True, "", exited_at=t), t)  # the OOM killer
    aborted = postmortem.died(2, "rank 2", StderrSection("f", True, enforce, exited_at=t + 0.002), t + 0.002)
    peer = RankFailure(1, "rank 1", "raised", gloo, at=t - 0.001, consequence=True)  # its clock runs behind
    silent = RankFailure(3, "rank 3", "no reply", "no reply")
    own = RankFailure(5, "rank 5", "raised", "ValueError: bad input", at=t + 5)
    ordered = postmortem.order([silent, peer, aborted, own, killed])
    assert [f.rank for f in ordered] == [4, 5, 2, 1, 3]  # causes by time, then consequences (deaths first)
    assert "Fatal Python error: Aborted" in aborted.stderr_excerpt


# ---------------------------------------------------------------- Slurm hetjob route
# conftest.py gates `slurm` tests: skipped without a cluster, failed without one when CI=true
def _sbatch_and_wait(args: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> str:
    """`sbatch --output=LOG ARGS` from the repo, waited for (cancelled after timeout_s); the job's log."""
    job = subprocess.run(["sbatch", "--parsable", f"--output={log}", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    try:
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=30).stdout.strip():
            if time.monotonic() > deadline:
                pytest.fail(f"hetjob {job} did not finish in time")
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)  # no-op when already done
    return "\n".join(p.read_text(errors="replace") for p in log.parent.glob(log.name.replace("%j", "*")))


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_slurm_hetjob_one_world(tmp_path: Path) -> None:
    """sbatch/check_world.sh, as a user submits it: one world over both het groups."""
    out = tmp_path / "slurm.json"
    logs = _sbatch_and_wait(["sbatch/check_world.sh", str(out)], tmp_path / "slurm-%j.out", 120)
    assert out.exists(), logs[-3000:]
    data = json.loads(out.read_text())
    ctrl, workers = data["controller"], data["workers"]
    assert ctrl["mpi_size"] == 5 and all(w["mpi_size"] == 5 for w in workers)  # ONE world
    assert ctrl["slurm"]["SLURM_HET_SIZE"] == "2"
    worker_nodes = {w["node"] for w in workers}
    assert len(worker_nodes) == 2 and ctrl["slurm"]["SLURMD_NODENAME"] not in worker_nodes
    assert [w["mpi_rank"] for w in workers] == [1, 2, 3, 4]
    assert all(w["gloo_world"] == 4.0 for w in workers)
    assert data["y"] == [0, 1, 1002, 1003, 2004, 2005, 3006, 3007]
    assert "[check_world] OK: one MPI world" in logs


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_slurm_world_starts_with_a_dirty_heap(tmp_path: Path) -> None:
    """MPI_Init over Slurm's pmi2 with the launcher's environment, every rank's heap full of non-zero bytes.

    Without hpcrl/launch/commands.py's SLURM_PMI2_ENV (MPIR_CVAR_CH4_NETMOD=ucx, measured 2 of 2 and
    every trainer start of one CI run) slurmstepd logs `value not properly terminated` and the world
    never starts: MPICH's UCX address exchange writes PMI lines longer than the plugin reads.
    """
    out = tmp_path / "world.json"
    srun = shlex.join(srun_het_command([sys.executable, str(REPO / "tests" / "programs" / "dirty_heap_world.py"),
                                        str(out)]))
    script = tmp_path / "dirty_heap.sh"
    script.write_text("#!/bin/bash\n"
                      "#SBATCH --partition=normal --nodes=1 --ntasks-per-node=1 --cpus-per-task=1 --mem=1G --time=5\n"
                      "#SBATCH hetjob\n"
                      "#SBATCH --partition=normal --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 --mem=1G\n"
                      f"timeout 90 {srun}\n")
    env = srun_env({k: v for k, v in os.environ.items() if k != "MPIR_CVAR_CH4_NETMOD"})
    logs = _sbatch_and_wait([str(script)], tmp_path / "dirty-%j.out", 180, env=env)
    assert "not properly terminated" not in logs and out.exists(), logs[-3000:]
    world = json.loads(out.read_text())
    assert world["size"] == 5 and len(set(world["nodes"])) == 3 and world["netmod"] == "ofi", world


@pytest.mark.world
def test_a_world_that_cannot_start_ends_within_the_init_bound(tmp_path: Path) -> None:
    """Rank 1 never starts MPI: without HPCRL_MPI_INIT_TIMEOUT rank 0 spins in MPI_Init for good
    (measured: still spinning after 10 min); with it, the kernel ends rank 0 and the world fails."""
    rank1_never_starts = (f'if [ "$PMI_RANK" = 0 ]; then exec {sys.executable} launchers/hpcrl_entry.py '
                          f'launchers/check_world.py {tmp_path}/out.json; else sleep 120; fi')
    t0 = time.monotonic()
    from hpcrl.launch.commands import find_mpiexec

    # plain hydra (not mpiexec_command's one proxy per rank): it ends rank 1 once rank 0 is gone
    r = subprocess.run([find_mpiexec(), "-n", "2", "bash", "-c", rank1_never_starts], cwd=Path(__file__).parent.parent,
                       env={**os.environ, "HPCRL_MPI_INIT_TIMEOUT": "5"}, capture_output=True, text=True,
                       timeout=100)
    took = time.monotonic() - t0
    assert r.returncode != 0 and not (tmp_path / "out.json").exists(), r.stdout + r.stderr
    assert took < 60, f"the world took {took:.0f} s to end"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
