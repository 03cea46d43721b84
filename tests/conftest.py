"""Shared test setup: paths, the offline environment, and the Slurm / GPU gates.

Slurm tests run against the real local cluster (`make slurm-up`, which `make test` runs). Without a
cluster they are skipped on a workstation, but with CI=true they run and fail, so CI can never go
green by skipping them. GPU tests are skipped without CUDA.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
HPCRL = str(Path(sys.executable).with_name("hpcrl"))
TINY_MODEL = REPO / "models" / "tiny-qwen2"
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
ARITH = REPO / "data" / "arith"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Tests never reach a model hub: everything they load is built offline by `make models`.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def slurm_problem() -> str | None:
    """Why the local Slurm cluster cannot be used, or None when it answers."""
    if shutil.which("sinfo") is None:
        return "Slurm is not installed (run `make slurm-up` as root)"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld is not answering (run `make slurm-up`)"
    if r.returncode != 0:
        return f"sinfo failed: {r.stderr.strip()[:200]} (run `make slurm-up`)"
    return None


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install counts as no GPU
        return False


# Fixtures that start a multi-rank world, an `hpcrl run` or Slurm jobs: a test that uses one is a `world`
# test (what `make test-quick` leaves out), like the tests marked `world` or `slurm` themselves.
WORLD_FIXTURES = {"checks", "killed_world", "scenarios", "grpo_reference", "one_step_off", "fully_async_run",
                  "moe_ep2", "ppo", "bf16_run", "tools_run", "lora_run", "dpo_tiny", "jobs", "slurm_cluster"}


def _shared_fixture_keys(item: pytest.Item) -> set[str]:
    """The module- and session-scoped fixtures of tests/ that an item uses, as keys naming one instance each."""
    info = getattr(item, "_fixtureinfo", None)
    named = dict(info.name2fixturedefs) if info else {}
    # a fixture taken through request.getfixturevalue(param) (tests/test_train.py's test_learns)
    manager = item.session._fixturemanager
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(value, str) and value not in named and value.isidentifier():
            named[value] = manager.getfixturedefs(value, item) or ()
    keys = set()
    for name, defs in named.items():
        if not defs or not defs[-1].baseid:  # pytest's own (tmp_path_factory, ...)
            continue
        scope = defs[-1].scope
        if scope == "session":
            keys.add(f"session:{name}")
        elif scope in ("module", "package"):
            keys.add(f"{item.nodeid.split('::')[0]}:{name}")
    return keys


# session fixtures built once for both workers (built_once): a test of any group may use them
SHARED_BETWEEN_WORKERS = {"grpo_reference", "moe_ep2"}


def xdist_groups(items: list[pytest.Item]) -> dict[str, str]:
    """How `make test` shares the suite between its two pytest-xdist workers (`--dist loadgroup`): every
    Slurm test in one group, run one after the other (they preempt each other's jobs, and one test stops
    the cluster's daemons), and tests that share a module or session fixture (a world, a run) in one group
    so that it is built once. Every other test goes wherever a worker is free. Returns nodeid -> group.
    The Slurm group is the longest chain (the FSDP, three-kills, USR1 and pool tests, the submit jobs):
    through a fixture of SHARED_BETWEEN_WORKERS they do not pull in the other tests that use it (~4 min of
    tests for grpo_reference): the first worker to need it builds it, the other waits for it (built_once)."""
    parent = {i.nodeid: i.nodeid for i in items}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_by_key: dict[str, str] = {}
    for item in items:
        keys = _shared_fixture_keys(item) - {"session:slurm_cluster"}  # only a check that the cluster answers
        if "slurm" in item.keywords:
            keys = (keys - {f"session:{name}" for name in SHARED_BETWEEN_WORKERS}) | {"slurm"}
        for key in keys:
            if key in first_by_key:
                parent[find(item.nodeid)] = find(first_by_key[key])
            else:
                first_by_key[key] = item.nodeid
    slurm_root = find(first_by_key["slurm"]) if "slurm" in first_by_key else None
    size = Counter(find(i.nodeid) for i in items)
    return {i.nodeid: "slurm" if find(i.nodeid) == slurm_root else find(i.nodeid)
            for i in items if size[find(i.nodeid)] > 1}


# `pytest -n 2 --dist loadgroup` (make test): the workers collect and compute the groups (xdist_groups); the
# main process's scheduler reads them from this file. (xdist's own loadgroup reads `xdist_group` marks into
# the node id, which pytest 9.2 no longer lets a plugin change: every test was a group of its own.)
GROUPS_FILE_ENV = "HPCRL_XDIST_GROUPS"


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="hpcrl-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE_ENV] = path  # the workers, started after this, inherit it
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; a hook only when xdist is loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with the scopes of xdist_groups: a group goes to one worker, whole."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first called once every worker has collected (and written the file)
                self.groups = json.loads(Path(os.environ[GROUPS_FILE_ENV]).read_text())
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "slurm" in item.keywords or WORLD_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.world)
    if getattr(config.option, "loadgroup", False) and os.environ.get(GROUPS_FILE_ENV):  # an xdist worker
        groups = xdist_groups(items)
        # the Slurm group is the longest chain: it is scheduled first (with --no-loadscope-reorder)
        items.sort(key=lambda i: groups.get(i.nodeid) != "slurm")
        tmp = f"{os.environ[GROUPS_FILE_ENV]}.{os.getpid()}"
        Path(tmp).write_text(json.dumps(groups))
        os.replace(tmp, os.environ[GROUPS_FILE_ENV])  # both workers write the same groups, whole
    slurm_items = [i for i in items if "slurm" in i.keywords]
    problem = slurm_problem() if slurm_items else None
    if problem and not IN_CI:
        for item in slurm_items:
            item.add_marker(pytest.mark.skipif(True, reason=problem))
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if gpu_items and not cuda_available():  # importing torch costs seconds: only when needed
        for item in gpu_items:
            item.add_marker(pytest.mark.skipif(True, reason="no CUDA device"))


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The local cluster must answer; in CI its absence is a failure, not a skip."""
    problem = slurm_problem()
    if problem:
        pytest.fail(f"local Slurm cluster unusable: {problem}")


# `make test-quick` sets this: a test it runs may start no world, `hpcrl run` or Slurm job (`run` below
# fails one that did, naming the marker it lacks), so the inner loop stays a few minutes
QUICK = os.environ.get("HPCRL_TEST_QUICK") == "1"


def started_a_world(cmd: list[str], returncode: int) -> bool:
    """Whether a finished command started a multi-rank world or a Slurm job: mpiexec, sbatch or srun
    (`sbatch --test-only` starts nothing), `hpcrl run|submit|pool` unless refused before anything
    started (exit status 2, or `submit --dry-run`)."""
    name = Path(str(cmd[0])).name if cmd else ""
    args = [str(a) for a in cmd[1:]]
    if name == "hpcrl":
        return bool(args) and args[0] in ("run", "submit", "pool") and "--dry-run" not in args and returncode != 2
    if name in ("sbatch", "srun"):
        return "--test-only" not in args
    return name.startswith("mpiexec")


def run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run a command from the repo root, capturing text output."""
    r = subprocess.run(cmd, cwd=kw.pop("cwd", REPO), capture_output=True, text=True, timeout=timeout, **kw)
    if QUICK and started_a_world(cmd, r.returncode):
        pytest.fail(f"`{' '.join(map(str, cmd[:3]))} ...` started a world or a Slurm job inside `make test-quick`: "
                    "mark the test `@pytest.mark.world` (or give it a world fixture, conftest.WORLD_FIXTURES)")
    return r


def hpcrl_cli(*args: str) -> subprocess.CompletedProcess:
    """`hpcrl ARGS` inside this process, from the repo root: hpcrl.cli.main with the command's own parser,
    checks, output and exit status, without a new interpreter importing torch (~3 s of CPU a call,
    ~4 s wall on the CI box). Only for `hpcrl ckpt`, `hpcrl plan` and `hpcrl status`, which start nothing
    and change no process state; the commands that start worlds or jobs, and those whose process is the
    point (`hpcrl config`'s exit codes, `hpcrl status` in tests/test_submit.py), go through `run`."""
    import contextlib
    import io

    from hpcrl.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO)  # relative model paths in a checkpoint's config resolve as they do for the command
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess([HPCRL, *args], code, out.getvalue(), err.getvalue())


# The tiny runs of the tests: 10 steps, TP=2 (over the recipe's 4 workers: DP=2), reward = share of
# digits in the output (a custom `module:function` reward the tiny model can learn).
TRAIN_STEPS = 10
TRAIN_OVERRIDES = ["reward.function=hpcrl.rewards.toy:digit_fraction", f"trainer.total_steps={TRAIN_STEPS}",
                   "trainer.val_every=0", "actor.parallel.tensor_parallel=2", "actor.optim.lr=5e-3",
                   "logging.tensorboard=false"]


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hpcrl_run(run_dir: Path, *overrides: str, timeout: float = 900, env: dict[str, str] | None = None) -> list[dict]:
    """`hpcrl run configs/grpo_tiny.yaml` on this machine; the run's step records. What the terminal
    showed is kept beside the run directory: `terminal.stdout`, `terminal.stderr`."""
    r = run([HPCRL, "run", "configs/grpo_tiny.yaml", f"trainer.run_dir={run_dir}", *TRAIN_OVERRIDES, *overrides],
            timeout=timeout, env={**os.environ, **(env or {})})
    (run_dir.parent / "terminal.stdout").write_text(r.stdout)
    (run_dir.parent / "terminal.stderr").write_text(r.stderr)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return read_jsonl(run_dir / "metrics.jsonl")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that `build(folder)` fills once per pytest run: under `make test`'s two xdist workers, the
    first worker to ask builds it while the other waits on a lock, then reads it (without xdist: built
    here). Readers must not change it: tests copy what they modify (test_resume.resumable_copy)."""
    import fcntl

    run_uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_uid:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    shared = tmp_path_factory.getbasetemp().parent / f"{name}-{run_uid[:12]}"  # pytest-N/: both workers'
    shared.mkdir(exist_ok=True)
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if not (shared / ".built").exists():
            folder = shared / "content"
            shutil.rmtree(folder, ignore_errors=True)  # a builder that failed left a part
            folder.mkdir()
            build(folder)
            (shared / ".built").touch()
    return shared / "content"


# The GRPO run that tests share (grpo_reference): tests/test_train.py checks that it learns, tests/test_resume.py
# that interrupted copies of it on Slurm end with the same weights and that its checkpoint resumes on other
# layouts. On 2 workers at TP=1 x DP=2: the optimizer's moments cut over DP, as on 4 workers at TP=2 x DP=2,
# and each of the 7 Slurm world starts of its interrupted copies has 2 ranks fewer to start (~12 CPU-s each
# on the loaded CI box: a worker's start is mostly importing torch, megatron-core and vLLM).
REFERENCE_LAYOUT = ["trainer.workers_per_node=2", "actor.parallel.tensor_parallel=1"]


@pytest.fixture(scope="session")
def grpo_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The uninterrupted GRPO run (saves every 4 steps, like the interrupted copies; REFERENCE_LAYOUT); one
    run for both xdist workers (the Slurm tests' and the others': built_once)."""
    folder = built_once(tmp_path_factory, "grpo", lambda f: hpcrl_run(f / "run", "algorithm.adv_estimator=grpo",
                                                                      "checkpoint.save_every=4", *REFERENCE_LAYOUT))
    return folder / "run", read_jsonl(folder / "run" / "metrics.jsonl")


# GRPO with the split placement: workers 1-2 train (TP=2), workers 3-4 run one vLLM engine each; one
# batch is generated ahead (rollout.max_staleness defaults to 1 there), with truncated importance weights
# the split placement on 3 workers: the trainer's 2 (TP=2) and 1 rollout worker (a second engine's start cost
# more CPU than the generating it took over)
SPLIT_OVERRIDES = ["trainer.placement=split", "trainer.workers_per_node=3", "trainer.rollout_workers=1",
                   "algorithm.rollout_correction=tis", "checkpoint.save_every=4"]


# the fully asynchronous rollout (hpcrl.trainer.stream): the engines generate 2 tokens a segment for
# samples of 16, so most samples cross a weight update; tokens up to 2 versions behind the trainer
FULLY_ASYNC = ["trainer.placement=split", "trainer.rollout_workers=2", "rollout.mode=fully_async",
               "rollout.segment_tokens=2", "rollout.max_staleness=2", "algorithm.rollout_correction=tis"]


# 1-token segments of 48-token samples: a batch takes far longer to generate than a step of this tiny model
# takes to train, so samples in flight cross weight updates whatever the machine's speed (with 2-token
# segments of 16, a CI machine generated every sample within one step: no sample spanned)
SPANNING_SEGMENTS = ["rollout.segment_tokens=1", "rollout.max_new_tokens=48"]


@pytest.fixture(scope="session")
def fully_async_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """4 steps of rollout.mode=fully_async (SPANNING_SEGMENTS), saved every step, all 4 kept: tests/test_train.py
    checks the stream's versions and log-probs, tests/test_resume.py resumes a copy of its step-2 checkpoint
    with a tighter staleness bound (one world for both)."""
    d = tmp_path_factory.mktemp("fully-async") / "run"
    return d, hpcrl_run(d, *FULLY_ASYNC, *SPANNING_SEGMENTS, "trainer.total_steps=4", "checkpoint.save_every=1",
                        "checkpoint.keep_last=4")


@pytest.fixture(scope="session")
def one_step_off(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The uninterrupted one-step-off run (tests/test_train.py checks it learns, and recomputes a
    queued batch's log-probs with the two checkpoints before it: saved every step, the last 3 kept;
    tests/test_resume.py resumes copies of its step-8 checkpoint, split and colocated)."""
    d = tmp_path_factory.mktemp("one-step-off") / "run"
    return d, hpcrl_run(d, *SPLIT_OVERRIDES, "checkpoint.save_every=1", "checkpoint.keep_last=3")


def hf_token_logprobs(model_dir: Path, batch: dict, temperature: float):
    """Token-aligned log p(ids[t] | ids[<t]) under softmax(logits / T) of an HF folder, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
            ids = batch["input_ids"][i, :int(n)]
            lp = torch.log_softmax(hf(ids[None]).logits[0].float() / temperature, -1)
            out[i, 1:int(n)] = lp[:-1].gather(-1, ids[1:, None])[:, 0]
    return out


# The tiny Qwen3-MoE at expert parallel 2 (configs/grpo_tiny_moe.yaml on 2 workers at TP=1, DP=2: each rank 4
# of the 8 experts; one vLLM fused-MoE engine at rollout TP 2), without the load-balancing loss: megatron's is
# a micro-batch's, so another DP size gives another term (tests/programs/moe_checks.py checks it at one). 2
# workers, not the recipe's 4: 2 ranks fewer in each of its 3 worlds (the expert-DP reduction of EP=2 on 4
# ranks: tests/programs/moe_checks.py's "moe update ep2")
MOE_EP2 = ["trainer.workers_per_node=2", "rollout.tensor_parallel=2", "actor.parallel.tensor_parallel=1",
           "actor.parallel.sequence_parallel=false", "actor.parallel.expert_parallel=2", "actor.moe.aux_loss_coeff=0"]


@pytest.fixture(scope="session")
def moe_ep2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The uninterrupted MoE run at EP=2: 3 steps, saved at step 2 (the config's save_every) and at the
    end. tests/test_train.py checks it and resumes a copy of its step-2 checkpoint at EP=2; tests/test_submit.py
    resumes a copy as a Slurm job on a node range at the config's TP=2 (one world for all three; one for both
    xdist workers: built_once)."""
    def build(folder: Path) -> None:
        r = run([HPCRL, "run", "configs/grpo_tiny_moe.yaml", f"trainer.run_dir={folder / 'run'}", *MOE_EP2,
                 "trainer.total_steps=3"], timeout=900)
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"

    d = built_once(tmp_path_factory, "moe-ep2", build) / "run"
    return d, read_jsonl(d / "metrics.jsonl")
