"""The sandbox (hpcrl.sandbox), the code-execution reward and the agent tool interface (hpcrl.agents.tools).

Each containment test runs an attack program in the sandbox and through the code-execution reward,
whose test case expects the output the attack prints when it works: the run must come back as a
result (nothing raised), score 0, and leave everything outside as it was. The limits come from
`limits(...)`; each test was also run once with its limit removed (a limit set to None, or a launcher
without the namespace / privilege drop) and failed, see docs/agents.md.

Isolation needs namespaces (and a cgroup): where the machine refuses them the sandbox tests are
skipped, and fail with CI=true (as the Slurm tests do), so CI cannot go green without testing them;
the same for the tests that need root (the privilege drop).

"Hostile model output" (issue 44): each of those tests gives the public API what a policy under
optimisation would write, and fails on the code before the fix (docs/agents.md, threat model).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import IN_CI, REPO

from hpcrl.agents.builtin_tools import CalculatorTool, load_tool, load_tools
from hpcrl.agents.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    ToolError,
    ToolSet,
    format_tool_call,
    format_tool_responses,
    parse_tool_calls,
    tool_messages,
)
from hpcrl.rewards import RewardInput, RewardScorer
from hpcrl.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError, run_program
from hpcrl.sandbox.reward import (
    HIDDEN_PATHS_ENV,
    extract_program,
    hide_run_paths_from_programs,
    make_code_reward,
    normalize_output,
    parse_test_cases,
)
from hpcrl.sandbox.runner import LAUNCHER, WORKDIR_PREFIX

ROOT = os.geteuid() == 0


@pytest.fixture
def root_only():
    """Tests of the root-started sandbox (the privilege drop to an unprivileged uid): skipped for other
    users on a workstation, a failure with CI=true (CI runs as root)."""
    if not ROOT:
        if IN_CI:
            pytest.fail("CI=true and the tests do not run as root: the privilege drop is not tested")
        pytest.skip("root-started sandboxes only (the privilege drop)")


def limits(**overrides) -> SandboxConfig:
    """The tests' limits: small, so that every attack is stopped within about a second."""
    base = SandboxConfig(wall_s=5.0, cpu_s=1.0, memory_mb=256, max_processes=16, max_file_mb=1.0,
                         max_output_bytes=64 << 10, disk_mb=16)
    return replace(base, **overrides)


@pytest.fixture(scope="module")
def sandbox_works():
    try:
        Sandbox(limits()).check()
    except SandboxUnavailableError as e:
        if IN_CI:
            pytest.fail(f"CI=true and the sandbox cannot isolate programs here: {e}")
        pytest.skip(str(e))


@pytest.fixture
def outside_dir():
    """A folder outside /tmp (the sandbox replaces /tmp with its own) that an unprivileged uid can reach."""
    base = "/run" if os.access("/run", os.W_OK) else str(Path(__file__).resolve().parent.parent)
    path = Path(tempfile.mkdtemp(prefix="hpcrl-sandbox-test-", dir=base))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def score_via_reward(config: SandboxConfig, program: str, expected_stdout: str, stdin: str = "") -> float:
    """The code-execution reward for a response holding `program`, with one test case expecting what
    the attack prints when it works."""
    reward = make_code_reward(config)
    truth = json.dumps([{"input": stdin, "output": expected_stdout}])
    return reward("code", f"Here it is:\n```python\n{program}\n```", truth)["score"]


# ----------------------------------------------------------------------------------------------------
# Containment

FORK_BOMB = """
import os, time
os.write(1, b"p")
refused = None
for _ in range(6):          # 2**6 = 64 processes in all when nothing stops it
    try:
        if os.fork() == 0:
            os.write(1, b"p")
    except BlockingIOError as e:
        refused = e
time.sleep(0.5)             # all alive at once: the count of p is the peak
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
if refused:
    raise refused
"""


def check_fork_bomb(config: SandboxConfig) -> None:
    r = run_program(FORK_BOMB, config=config)
    assert r.stdout.count("p") <= 16, f"{r.stdout.count('p')} processes ran"
    assert r.limit == "processes", r
    assert r.wall_s < 4.0
    assert score_via_reward(config, FORK_BOMB, "p" * 64) == 0.0


def test_fork_bomb_is_stopped_by_the_process_limit(sandbox_works):
    check_fork_bomb(limits())


def check_infinite_loop(config: SandboxConfig) -> None:
    r = run_program("while True:\n    pass\n", config=config)
    assert r.limit == "cpu" and r.signal == "SIGXCPU", r
    # ended by its CPU time, before the wall limit; how long 1 s of CPU takes on the wall depends on the load:
    # 1.04 s alone, 3.1 s beside two worlds under `make test`'s two workers (CI, 2026-12-07)
    assert r.wall_s < config.wall_s and 0.9 < r.cpu_s < 2.0, r
    assert score_via_reward(config, "while True:\n    pass\nprint('done')", "done") == 0.0


def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox_works):
    # the wall limit well above the CPU limit's wall time on a loaded box: beside a world and a Slurm job, 1 s
    # of CPU once took over 5 s (CI, 2026-12-07), and the 5-s wall limit ended the loop first
    check_infinite_loop(limits(wall_s=30.0))


def test_sleeping_program_is_stopped_by_the_wall_limit(sandbox_works):
    r = run_program("import time\nprint('start', flush=True)\ntime.sleep(60)\n", config=limits(wall_s=1.0))
    assert r.limit == "timeout" and r.exit_code is None and r.stdout == "start\n", r
    assert r.wall_s < 2.0


TEN_GB = "b = bytes(10 * 2**30)\nprint('allocated', len(b))\n"


def check_memory_bomb(config: SandboxConfig) -> None:
    r = run_program(TEN_GB, config=config)
    assert r.limit == "memory" and "MemoryError" in r.stderr and r.stdout == "", r
    assert r.max_rss_mb < 300  # refused up front: never touched more than the limit
    assert score_via_reward(config, TEN_GB, f"allocated {10 * 2**30}") == 0.0


def test_10gb_allocation_is_refused_by_the_memory_limit(sandbox_works):
    check_memory_bomb(limits())


def network_attack(port: int) -> str:
    return f"""
import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"leak")
    print("connected")
except OSError as e:
    print("refused:", type(e).__name__, e)
"""


def check_network(config: SandboxConfig) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        program = network_attack(listener.getsockname()[1])
        r = run_program(program, config=config)
        assert r.stdout.startswith("refused:") and r.limit is None, r
        assert score_via_reward(config, program, "connected") == 0.0
        with pytest.raises(BlockingIOError):  # nobody knocked
            listener.accept()


def test_network_connection_to_the_host_fails(sandbox_works):
    check_network(limits())


def write_attack(*targets: Path) -> str:
    return f"""
import os
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "w") as f:
            f.write("overwritten")
        print("wrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
"""


def check_writes_outside(config: SandboxConfig, tmp_path: Path, outside: Path) -> None:
    private = tmp_path / "run"  # the run's files: a root-owned 0700 folder with a file in it
    private.mkdir(mode=0o700)
    (private / "state.txt").write_text("original")
    (outside / "shared").mkdir(mode=0o777)  # world-writable, outside /tmp: only the read-only host stops it
    (outside / "shared").chmod(0o1777)
    in_host_tmp = Path(tempfile.gettempdir()) / f"hpcrl-sandbox-escape-{os.getpid()}"
    targets = [private / "state.txt", private / "new.txt", outside / "shared" / "new.txt", in_host_tmp]
    program = write_attack(*targets)
    try:
        r = run_program(program, config=config)
        # the host's /tmp is not the program's: writing its own /tmp works and stays inside
        assert r.ok and r.stdout.count("refused") == 3 and r.stdout.endswith(f"wrote {in_host_tmp}\n"), r
        assert score_via_reward(config, program, "\n".join(f"wrote {t}" for t in targets)) == 0.0
        assert (private / "state.txt").read_text() == "original"
        assert not (private / "new.txt").exists()
        assert not (outside / "shared" / "new.txt").exists()
        assert not in_host_tmp.exists()
    finally:
        in_host_tmp.unlink(missing_ok=True)


def test_writes_outside_the_working_directory_fail(sandbox_works, tmp_path, outside_dir):
    check_writes_outside(limits(), tmp_path, outside_dir)


def read_attack(path: Path) -> str:
    return f"""
try:
    print(open({str(path)!r}).read())
except OSError as e:
    print("refused", type(e).__name__)
"""


def check_run_files_unreadable(config: SandboxConfig, run_dir: Path) -> None:
    secret = run_dir / "secret.txt"
    secret.write_text("the-run-secret")
    r = run_program(read_attack(secret), config=config)
    assert r.ok and r.stdout.startswith("refused") and "the-run-secret" not in r.stdout, r
    assert score_via_reward(config, read_attack(secret), "the-run-secret") == 0.0


def test_a_root_owned_0700_folder_is_unreadable(root_only, sandbox_works, outside_dir):
    run_dir = outside_dir / "run"  # outside /tmp: the permissions are what protects it
    run_dir.mkdir(mode=0o700)
    check_run_files_unreadable(limits(), run_dir)


def test_a_world_readable_hidden_path_is_unreadable(sandbox_works, outside_dir):
    run_dir = outside_dir / "run"  # readable by everyone: only hiding it protects it
    run_dir.mkdir(mode=0o755)
    check_run_files_unreadable(limits(hidden_paths=(str(run_dir),)), run_dir)


def test_secrets_of_the_environment_are_not_visible(sandbox_works, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-123")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-456")
    program = """
import os
print(sorted(os.environ))
print(repr(os.environ.get("WANDB_API_KEY")), repr(os.environ.get("HF_TOKEN")))
seen = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for name in ("environ", "cmdline"):
            try:
                seen.append(open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace"))
            except OSError:
                pass
print("proc:", " ".join(seen))
"""
    r = run_program(program, config=limits())
    assert r.ok, r
    assert "secret" not in r.stdout and "None None" in r.stdout, r.stdout
    assert set(eval(r.stdout.splitlines()[0])) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"}


def test_the_working_directory_is_private_and_deleted(sandbox_works):
    program = "import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n"
    r = run_program(program, config=limits())
    assert r.ok, r
    cwd, listing = r.stdout.splitlines()
    assert listing == "['main.py', 'out.txt']"
    assert not os.path.exists(cwd)
    assert not list(Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}{os.getpid()}-*"))


def processes_of_uid(uid: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        real_uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        if int(real_uid) == uid:
            pids.append(int(pid))
    return pids


def test_processes_left_behind_are_killed(root_only, sandbox_works):
    """A daemon (new session, stdio closed) does not outlive the program, nor keep the run waiting."""
    daemon = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        time.sleep(60)
    os._exit(0)
time.sleep(0.2)
print(os.getuid())
"""
    r = run_program(daemon, config=limits())
    assert r.ok and r.wall_s < 3.0, r
    assert processes_of_uid(int(r.stdout)) == []


def test_output_and_file_size_limits(sandbox_works):
    r = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n", config=limits())
    assert r.limit == "output" and r.stdout_truncated and len(r.stdout) == 64 << 10, (r.limit, len(r.stdout))
    r = run_program("open('big', 'wb').write(b'x' * (2 << 20))\n", config=limits())
    assert r.limit == "file_size" and "File too large" in r.stderr, r


def test_stdin_argv_and_exit_status(sandbox_works):
    r = run_program("import sys\nprint(input()[::-1], sys.argv[1:])\nsys.exit(3)\n", stdin="abc\n",
                    argv=["x", "y"], config=limits())
    assert (r.stdout, r.exit_code, r.limit, r.error) == ("cba ['x', 'y']\n", 3, None, None)
    big = "".join(f"{i}\n" for i in range(100_000))  # more than a pipe holds: fed while output is read
    r = run_program("import sys\nprint(sum(int(x) for x in sys.stdin))\n", stdin=big, config=limits())
    assert r.stdout == f"{sum(range(100_000))}\n", r


def test_concurrent_runs_and_a_fork_bomb_beside_them(sandbox_works):
    """Concurrent runs get distinct uids, so a fork bomb's process count does not starve the others."""
    # each run forks a child that prints, and waits for it: a run ends when its first process
    # does, and a child still running then is killed with the run (it printed nothing in one CI run)
    forks = "import os\npid = os.fork()\nif pid:\n    os.waitpid(pid, 0)\nelse:\n    print({})\n"
    with Sandbox(limits(), max_concurrency=3) as box:
        async def main():
            return await asyncio.gather(box.run_async(FORK_BOMB), *(box.run_async(forks.format(i)) for i in range(5)))
        t0 = time.monotonic()
        bomb, *others = asyncio.run(main())
        elapsed = time.monotonic() - t0
    assert bomb.limit == "processes"
    assert [o.stdout for o in others] == [f"{i}\n" for i in range(5)] and all(o.ok for o in others)
    assert elapsed < 10.0


def test_refuses_to_start_without_namespaces_unless_allowed(monkeypatch, tmp_path):
    """Where namespaces cannot be made, the sandbox refuses with what to do; the opt-out runs anyway."""
    fake = tmp_path / "launcher.py"
    source = Path(__file__).resolve().parent.parent / "hpcrl" / "sandbox" / "_launcher.py"
    fake.write_text(source.read_text().replace("if _libc.unshare(flags) == 0:",
                                               "if _libc.unshare(flags) == 0 and False:"))
    monkeypatch.setattr("hpcrl.sandbox.runner.LAUNCHER", str(fake))
    with pytest.raises(SandboxUnavailableError, match="allow_host_network_fallback=True"):
        run_program("print(1)", config=limits())
    r = run_program("print(1)", config=limits(allow_host_network_fallback=True))
    assert r.ok and r.stdout == "1\n" and r.isolation["namespaces"] is False


# ----------------------------------------------------------------------------------------------------
# The code-execution reward

SQUARE_IO = json.dumps({"inputs": ["3\n", "12\n", "-4\n"], "outputs": ["9\n", "144\n", "16"]})


def fenced(program: str) -> str:
    return f"Let me think.\n```python\nprint('draft')\n```\nFinal:\n```python\n{program}\n```\n"


def test_code_reward_on_small_programs(sandbox_works):
    fraction = make_code_reward(limits())
    all_or_nothing = make_code_reward(limits(), all_or_nothing=True)
    correct = fenced("n = int(input())\nprint(n * n)")
    half = fenced("n = int(input())\nprint(n * n if n > 0 else n)")  # wrong for negative n
    loop = fenced("while True:\n    pass")
    assert fraction("code", correct, SQUARE_IO) == {"score": 1.0, "acc": 1.0, "format": 1.0, "pass_rate": 1.0,
                                                     "tests": 3.0, "limit_hit": 0.0}
    assert fraction("code", half, SQUARE_IO)["score"] == pytest.approx(2 / 3)
    assert all_or_nothing("code", half, SQUARE_IO)["score"] == 0.0
    out = fraction("code", loop, SQUARE_IO)
    assert (out["score"], out["limit_hit"]) == (0.0, 1.0)
    assert fraction("code", "no code here", SQUARE_IO)["format"] == 0.0
    asserts = json.dumps(["assert add(2, 3) == 5", "assert add(-1, 1) == 0"])
    assert fraction("code", fenced("def add(a, b):\n    return a + b"), asserts)["score"] == 1.0
    # exiting before the asserts run passes nothing
    assert fraction("code", fenced("import sys\ndef add(a, b):\n    return 0\nsys.exit(0)"), asserts)["score"] == 0.0


def test_code_reward_in_the_reward_workers(sandbox_works):
    """As configured in a run: reward.function=hpcrl.sandbox.reward:fraction_passed, in worker processes."""
    items = [RewardInput("code", fenced(p), SQUARE_IO) for p in
             ("n = int(input())\nprint(n * n)", "print(0)", "while True:\n    pass")]
    with RewardScorer("hpcrl.sandbox.reward:fraction_passed", timeout_s=20.0, workers=1) as scorer:
        r = scorer.score(items)
    assert r.scores == [1.0, 0.0, 0.0]
    assert r.metrics["reward/errors"] == 0 and r.metrics["reward/limit_hit"] == pytest.approx(1 / 3)


def test_test_case_formats():
    assert [c.kind for c in parse_test_cases(SQUARE_IO)] == ["io"] * 3
    cases = parse_test_cases("ignored", {"test_cases": [{"input": ["1", "2"], "output": "3"}]})
    assert (cases[0].input, cases[0].output) == ("1\n2", "3")
    with pytest.raises(ValueError, match="call-based"):
        parse_test_cases(json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": "f"}))
    with pytest.raises(ValueError, match="not JSON"):
        parse_test_cases("print(1)")
    assert normalize_output("a  \r\nb\n\n") == normalize_output("a\nb")
    assert extract_program("```py\nx = 1\n```") == "x = 1\n"
    assert extract_program("```python\nunfinished") is None


# ----------------------------------------------------------------------------------------------------
# Tools: parsing, execution, formatting


class Echo(Tool):
    name = "echo"
    description = "Echo the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
                  "required": ["text"], "additionalProperties": False}

    def call(self, arguments):
        return arguments["text"] * arguments.get("times", 1)


class Broken(Tool):
    name = "broken"
    description = "Always raises."

    def call(self, arguments):
        raise KeyError("missing")


class Slow(Tool):
    name = "slow"
    description = "Sleeps."
    timeout_s = 0.2

    async def acall(self, arguments):
        await asyncio.sleep(10)


def test_parse_tool_calls():
    text = ('I will use tools.\n<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "x",}}</tool_call>'
            '<tool_call>["not", "an", "object"]</tool_call>'
            '<tool_call>{"name": "echo", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "echo"')
    items = parse_tool_calls(text)
    assert [type(i).__name__ for i in items] == ["ToolCall", "ToolCall"] + ["ToolCallError"] * 4
    assert (items[0].name, items[0].arguments) == ("echo", {"text": "hi"})
    assert (items[1].name, items[1].arguments) == ("calculator", {"expression": "1+1"})  # arguments as a string
    assert "not valid JSON" in items[2].message and "line 1 column" in items[2].message
    assert '"name" string' in items[3].message
    assert "must be a JSON object, got list" in items[4].message
    assert "not closed" in items[5].message
    assert parse_tool_calls("no calls at all") == []
    call = format_tool_call("echo", {"text": "hi"})
    assert parse_tool_calls(call) == [ToolCall("echo", {"text": "hi"}, call[len("<tool_call>"):-len("</tool_call>")]
                                               .strip())]


def test_tool_set_never_raises():
    tools = ToolSet([Echo(), Broken(), Slow(), CalculatorTool()], default_timeout_s=5.0)
    items = [ToolCall("echo", {"text": "ab", "times": 2}), ToolCall("nope", {}), ToolCall("echo", {"times": "2"}),
             ToolCall("echo", {"text": "a", "loud": True}), ToolCall("broken", {}), ToolCall("slow", {}),
             ToolCallError("the tool call is not valid JSON"), ToolCall("calculator", {"expression": "2 ** 10"})]
    t0 = time.monotonic()
    results = tools.execute_sync(items)
    assert time.monotonic() - t0 < 3.0  # the slow tool was cut at its 0.2 s, concurrently with the rest
    assert [r.error_kind for r in results] == [None, "unknown_tool", "bad_arguments", "bad_arguments", "exception",
                                               "timeout", "parse", None]
    assert [r.error for r in results] == [False, True, True, True, True, True, True, False]
    assert results[0].content == "abab" and results[7].content == "1024"
    assert "unknown tool 'nope'" in results[1].content and "echo, broken, slow, calculator" in results[1].content
    assert "arguments.text is required" in results[2].content and "must be integer" in results[2].content
    assert "arguments.loud is not a parameter" in results[3].content
    assert results[4].content == "Error: broken failed: KeyError: 'missing'"
    assert results[5].content == "Error: slow did not finish within 0.2 s."
    assert all(r.content.startswith("Error: ") for r in results if r.error)
    schema = tools.schemas()[0]
    assert schema["type"] == "function" and schema["function"]["name"] == "echo"


def test_tool_responses_as_the_chat_template_renders_them():
    tools = ToolSet([Echo()])
    results = tools.execute_sync([ToolCall("echo", {"text": "one"}), ToolCall("echo", {"text": "two"})])
    assert format_tool_responses(results) == ("<|im_start|>user\n<tool_response>\none\n</tool_response>\n"
                                              "<tool_response>\ntwo\n</tool_response><|im_end|>\n")
    assert tool_messages(results) == [{"role": "tool", "name": "echo", "content": "one"},
                                      {"role": "tool", "name": "echo", "content": "two"}]


@pytest.mark.parametrize("expression, want", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("-2 ** 2", "-4"), ("7 / 2", "3.5"), ("7 // 2", "3"),
    ("-7 % 3", "2"), ("2 ** 100", str(2 ** 100)), ("1.5e3 - 0.5", "1499.5"), ("2 ** -1", "0.5"), ("--3", "3"),
])
def test_calculator(expression, want):
    assert CalculatorTool().evaluate(expression) == want


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"), ("2 ^ 3", r"use \*\* for powers"), ("__import__('os')", "function calls"),
    ("x + 1", "names are not allowed"), ("9 ** 9 ** 9", "exponents are limited"), ("2 ** 5000", "digits"),
    ("10.0 ** 400", "too large"), ("(-8) ** 0.5", "complex"), ("'a' * 3", "only numbers"), ("1 +", "not an"),
    ("(" * 300 + "1" + ")" * 300, "not an"), ("1 < 2", "comparisons"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises(ToolError, match=message):
        CalculatorTool().evaluate(expression)


def test_load_tools():
    echo_spec = {"class": f"{__name__}:Echo"}
    tools = load_tools(["calculator", echo_spec, {"class": "calculator", "kwargs": {"max_exponent": 10}}])
    assert [t.name for t in tools] == ["calculator", "echo", "calculator"]
    assert tools[2].max_exponent == 10
    for spec, match in [({"class": "nomodule_xyz:Tool"}, "cannot import"), ({"class": f"{__name__}:limits"},
                        "not a subclass"), ({"class": "calculator", "kwargs": {"bad": 1}}, "bad kwargs"),
                        ({"class": "calculator", "args": {}}, "unknown keys"), ("no_such_tool", "package.module")]:
        with pytest.raises(ValueError, match=match):
            load_tool(spec)


def test_python_tool(sandbox_works):
    # the wall limit far above the CPU limit: beside two worlds in CI, `while True: pass` once got less
    # than 1 s of CPU in 5 s of wall and was stopped by the wall limit (CI, 2026-12-07)
    tool = load_tool({"class": "python", "kwargs": {"wall_s": 60.0, "cpu_s": 1.0, "max_output_chars": 100}})
    tools = ToolSet([tool])
    ok, loop, noisy = tools.execute_sync([
        ToolCall("python", {"code": "print(6 * 7)"}),
        ToolCall("python", {"code": "while True: pass"}),
        ToolCall("python", {"code": "print('y' * 1000)\nraise SystemExit(2)"}),
    ])
    assert (ok.content, ok.error) == ("stdout:\n42\n", False)
    assert loop.content == "stopped: CPU time limit" and loop.metadata["limit"] == "cpu"
    assert "characters cut" in noisy.content and noisy.content.endswith("exit status 2")


# ----------------------------------------------------------------------------------------------------
# Hostile model output (issue 44): each test failed on the code before its fix

NESTED_TMPFS = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
out = subprocess.run(["unshare", "-U", "-r", "true"], capture_output=True)
print("unshare -U:", "ok" if out.returncode == 0 else "refused")
if libc.unshare(0x10000000 | 0x00020000) != 0:          # CLONE_NEWUSER | CLONE_NEWNS
    print("refused", os.strerror(ctypes.get_errno()))
else:
    uid = os.getuid()
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
    os.makedirs("/tmp/big", exist_ok=True)
    if libc.mount(b"t", b"/tmp/big", b"tmpfs", 0, b"size=1g") != 0:
        print("mount refused", os.strerror(ctypes.get_errno()))
    else:
        written = 0
        with open("/tmp/big/fill", "wb") as f:
            for _ in range(48):                          # 48 MB: three times disk_mb
                f.write(b"x" * (1 << 20))
                written += 1
        print("mounted", written, "MB")
"""


def test_no_user_namespaces_inside_so_no_tmpfs_beyond_disk_mb(sandbox_works):
    """A program may not make a user namespace of its own (the seccomp filter): without one it cannot
    mount a tmpfs past disk_mb. Before: `mounted 48 MB` under disk_mb=16."""
    r = run_program(NESTED_TMPFS, config=limits(disk_mb=16, max_file_mb=None))
    assert r.exit_code == 0 and r.stdout.splitlines() == ["unshare -U: refused", "refused Operation not permitted"], r
    assert score_via_reward(limits(disk_mb=16, max_file_mb=None), NESTED_TMPFS,
                            "unshare -U: ok\nmounted 48 MB") == 0.0


MEMFD_HOARD = """
import os
held = []
for i in range(40):                                      # 640 MB of memfds, none of it address space
    fd = os.memfd_create(f"hoard{i}")
    os.write(fd, b"x" * (16 << 20))
    held.append(fd)
    print(16 * len(held), flush=True)
print("held", 16 * len(held))
"""

SYSV_HOARD = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for i in range(40):                                      # 640 MB of SysV segments, detached after filling
    seg = libc.shmget(0, 16 << 20, 0o600 | 0o1000)       # IPC_PRIVATE, IPC_CREAT
    addr = libc.shmat(seg, None, 0)
    ctypes.memset(addr, 1, 16 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
    held += 16
    print(held, flush=True)
print("held", held)
"""


@pytest.mark.parametrize("hoard", [MEMFD_HOARD, SYSV_HOARD], ids=["memfd", "sysv_shm"])
def test_shared_memory_hoards_are_killed_at_the_run_memory_limit(sandbox_works, hoard):
    """memfds and SysV segments are not address space (RLIMIT_AS lets 640 MB through under
    memory_mb=128); the run's cgroup counts their pages and its OOM kill ends the run. Before: `held 640`
    (host Shmem up by 640 MB while it ran)."""
    config = limits(memory_mb=128, disk_mb=16, max_file_mb=16.0)  # 16 MB: each memfd may hold its 16 MB
    r = run_program(hoard, config=config)
    held = [int(x) for x in r.stdout.split() if x.isdigit()]
    assert r.limit == "memory" and r.signal == "SIGKILL" and r.usage["oom_kills"] >= 1, r
    assert "held" not in r.stdout and max(held, default=0) <= 128 + 16, r.stdout
    assert r.usage["peak_memory_mb"] <= 128 + 16 + 1
    assert score_via_reward(config, hoard, "\n".join(str(16 * k) for k in range(1, 41)) + "\nheld 640") == 0.0


def test_refuses_to_start_without_a_cgroup_unless_allowed(sandbox_works, monkeypatch):
    monkeypatch.setattr("hpcrl.sandbox.runner.cgroup_layout", lambda: (None, "no cgroup for this test"))
    with pytest.raises(SandboxUnavailableError, match="no cgroup for this test.*allow_without_cgroup=True"):
        run_program("print(1)", config=limits())
    r = run_program("print(1)", config=limits(allow_without_cgroup=True))
    assert r.ok and r.stdout == "1\n" and r.isolation["cgroup"] is None and r.usage == {}


def test_limits_are_not_read_from_what_a_program_prints(sandbox_works):
    """A correct program that writes the kernel's words to stderr hit no limit. Before: limit
    "memory", score 0."""
    noisy = ("import sys\nn = int(input())\nprint(n * n)\n"
             "sys.stderr.write('MemoryError\\n[Errno 11] Resource temporarily unavailable\\n"
             "[Errno 27] File too large\\n')\n")
    r = run_program(noisy, stdin="3\n", config=limits())
    assert (r.ok, r.limit, r.stdout) == (True, None, "9\n"), r
    assert make_code_reward(limits())("code", fenced(noisy), SQUARE_IO)["score"] == 1.0
    # the same words from a program that died of the limit: recognised from its exit status
    r = run_program("x = bytes(10 * 2**30)", config=limits())
    assert (r.limit, r.exit_code) == ("memory", 1), r


ADD_ASSERTS = json.dumps(["assert add(2, 3) == 5", "assert add(10, -4) == 6", "assert add(1, 1) == 2"])

ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
def add(a, b):
    return Anything()
"""

# prints every marker-like token of its own source at exit (after the failed assert) and exits 0
MARKER_AT_EXIT = """
import atexit, os, re, sys
source = open(sys.argv[0]).read()
def claim():
    for token in re.findall(r"hpcrl-[a-z-]+-[0-9a-f]{12,}", source):
        print(token, flush=True)
    os._exit(0)
atexit.register(claim)
sys.excepthook = lambda *exc: claim()
def add(a, b):
    return a * b
"""


def test_assert_cases_cannot_be_passed_without_solving_them(sandbox_works):
    """The asserts run in a harness process apart from the solution, which only computes add(2, 3)
    and never sees the expected values or a marker. Before: both attacks scored 1.0."""
    reward = make_code_reward(limits())
    assert reward("code", fenced("def add(a, b):\n    return a + b"), ADD_ASSERTS)["score"] == 1.0
    assert reward("code", fenced(ALWAYS_EQUAL), ADD_ASSERTS)["score"] == 0.0
    assert reward("code", fenced(MARKER_AT_EXIT), ADD_ASSERTS)["score"] == 0.0
    # strict types: 5.0 is not 5, True is not 1; an int subclass is not plain data
    assert reward("code", fenced("def add(a, b):\n    return float(a + b)"), ADD_ASSERTS)["score"] == 0.0
    sub = "class I(int):\n    pass\ndef add(a, b):\n    return I(a + b)"
    assert reward("code", fenced(sub), ADD_ASSERTS)["score"] == 0.0
    # the usual MBPP shapes still work: a literal beside the solution's value stays with the harness
    shapes = json.dumps(["import math\nassert math.isclose(area(2), 12.566, rel_tol=1e-3)",
                         "assert sorted(evens([3, 2, 4])) == [2, 4]", "assert list(squares(3)) == [0, 1, 4]",
                         "assert abs(area(1) - 3.14159) < 1e-3"])
    solution = ("import math\ndef area(r):\n    return math.pi * r * r\ndef evens(xs):\n    return [x for x in xs if "
                "x % 2 == 0]\ndef squares(n):\n    return (i * i for i in range(n))")
    assert reward("code", fenced(solution), shapes)["score"] == 1.0


def sandboxed_sleeper(data_source, solution_str, ground_truth, extra_info=None):
    """A reward (loaded by the scorer's workers as test_sandbox:sandboxed_sleeper) that runs a program
    for 30 s regardless of the scorer's timeout."""
    return float(run_program("import time\ntime.sleep(30)\n", config=limits(wall_s=30.0)).ok)


def launcher_processes(caller_pid: int) -> list[int]:
    """Sandbox launchers and inits started by process `caller_pid` (its working folders, in the
    launcher's hex-encoded spec, carry that pid)."""
    mark = f"{WORKDIR_PREFIX}{caller_pid}-".encode().hex().encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if LAUNCHER.encode() in cmdline and mark in cmdline:
            found.append(int(pid))
    return found


def test_code_reward_ends_inside_the_scorers_timeout(sandbox_works):
    """Six cases of 1.5 s, two at a time, against reward.timeout_s=3: the reward cuts its runs at the
    scorer's deadline and scores a time limit. Before: the scorer killed the worker (a timeout)."""
    slow = json.dumps([{"input": "", "output": "done"}] * 6)
    item = RewardInput("code", fenced("import time\ntime.sleep(1.5)\nprint('done')"), slow)
    with RewardScorer("hpcrl.sandbox.reward:fraction_passed", timeout_s=3.0, workers=1) as scorer:
        scorer.score([RewardInput("code", fenced("print(1)"), json.dumps([{"input": "", "output": "1"}]))])
        r = scorer.score([item])
    assert r.metrics["reward/timeouts"] == 0 and r.details[0]["error"] is None, r.details
    assert r.scores == [0.0] and r.metrics["reward/limit_hit"] == 1.0
    assert r.metrics["time/reward"] < 3.0


def test_a_killed_reward_worker_leaves_no_program_running(sandbox_works):
    """The scorer kills a worker at its timeout; the worker's sandbox launchers (each in a session of
    its own) die with it, and with them init and the program. Before: all three ran on for 30 s."""
    with RewardScorer("test_sandbox:sandboxed_sleeper", timeout_s=1.5, workers=1) as scorer:
        worker = scorer.worker_pids[0]
        r = scorer.score([RewardInput("x", "", "", {})])
    assert r.metrics["reward/timeouts"] == 1
    end = time.monotonic() + 3.0
    while launcher_processes(worker) and time.monotonic() < end:
        time.sleep(0.05)
    assert launcher_processes(worker) == []


def test_python_tool_hides_the_runs_data_and_run_dir(sandbox_works, outside_dir, monkeypatch):
    """The python tool hides what the code reward hides plus the run's data folders and run directory,
    readable by everyone here. Before: the tool printed the ground truth."""
    monkeypatch.setenv(HIDDEN_PATHS_ENV, "")  # restored after the test
    data, run_dir = outside_dir / "data", outside_dir / "run"
    data.mkdir(mode=0o755)
    run_dir.mkdir(mode=0o755)
    (data / "train.jsonl").write_text('{"prompt": "2+2", "ground_truth": "the-answer-is-4"}\n')
    (run_dir / "state.txt").write_text("run-state-secret")
    hidden = hide_run_paths_from_programs({"data": {"train_files": [str(data / "train.jsonl")], "val_files": []},
                                           "trainer": {"run_dir": str(run_dir)}})
    assert {str(data), str(run_dir), str(REPO)} <= set(hidden)
    tools = ToolSet([load_tool({"class": "python", "kwargs": {"wall_s": 5.0, "cpu_s": 1.0}})])
    code = "\n".join(f"try:\n    print(open({str(p)!r}).read())\nexcept OSError as e:\n    print('refused')"
                     for p in (data / "train.jsonl", run_dir / "state.txt", REPO / "pyproject.toml"))
    (res,) = tools.execute_sync([ToolCall("python", {"code": code})])
    assert res.content == "stdout:\nrefused\nrefused\nrefused\n", res.content


def test_python_tool_clock_starts_when_the_program_starts(sandbox_works):
    """Calls queued behind others at max_concurrency=1 get their whole time once they run; a call that
    finds no free slot in time is answered as a queue timeout, not as its own. Before: the later calls
    were reported as the program's timeouts without running."""
    tool = load_tool({"class": "python", "kwargs": {"wall_s": 4.0, "cpu_s": 1.0, "max_concurrency": 1}})
    # each call's bound: well above one call (0.6 s and a start), below the 3 s the five take one after another
    tool.timeout_s = 2.5
    calls = [ToolCall("python", {"code": f"import time\ntime.sleep(0.6)\nprint({i})"}) for i in range(5)]
    results = ToolSet([tool]).execute_sync(calls)
    assert [r.content for r in results] == [f"stdout:\n{i}\n" for i in range(5)], [r.content for r in results]
    assert max(r.metadata["queued_s"] for r in results) > 2.0  # the last ones did wait
    tool.queue_timeout_s = 0.2
    first, queued = ToolSet([tool]).execute_sync([ToolCall("python", {"code": "import time\ntime.sleep(0.8)"}),
                                                  ToolCall("python", {"code": "print('never')"})])
    assert first.content == "(no output)" and not first.error
    assert queued.error_kind == "queue_timeout" and "was not run" in queued.content, queued


def test_a_venv_inside_a_hidden_project_is_bound_back_read_only(root_only, sandbox_works, outside_dir):
    """A non-root caller whose interpreter is a venv inside the project: the project (with its data)
    and $HOME are hidden all the same, and the venv is bound back read-only so the program runs.
    Before: default_hidden_paths left the project visible, and the program read the data."""
    project = outside_dir / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.jsonl").write_text("ground-truth-42\n")
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(project / ".venv")], check=True)
    for p in [project, *project.rglob("*")]:
        if not p.is_symlink():  # chmod follows links: the venv's bin/python is the system's interpreter
            p.chmod(0o755 if p.is_dir() else 0o644)
    secret = project / "data" / "train.jsonl"
    script = f"""
import json
from hpcrl.sandbox import SandboxConfig, run_program
from hpcrl.sandbox.reward import default_hidden_paths
program = "import sys\\ntry:\\n    print(open({str(secret)!r}).read())\\nexcept OSError:\\n    print('refused')"
program += "\\nprint(sys.prefix)"
r = run_program(program, config=SandboxConfig(hidden_paths=default_hidden_paths(), allow_without_cgroup=True))
print(json.dumps({{"hidden": default_hidden_paths(), "stdout": r.stdout, "stderr": r.stderr[-500:]}}))
"""
    out = subprocess.run([str(project / ".venv" / "bin" / "python"), "-c", script], cwd=project, user=65534,
                         group=65534, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(project), "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert str(project) in seen["hidden"], seen
    assert seen["stdout"] == f"refused\n{project / '.venv'}\n", seen
