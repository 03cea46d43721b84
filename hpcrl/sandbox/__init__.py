"""Run untrusted Python programs (model-written code) with limits and without access to the machine.

- `config.py`    SandboxConfig: wall/CPU time, memory, processes, file size, output, private disk,
                 hidden paths, the explicit opt-out `allow_host_network_fallback`.
- `runner.py`    run_program (one run, blocking) and Sandbox (many runs: a concurrency cap, sync,
                 run_many, asyncio run_async); SandboxResult (exit status, capped output, the limit
                 hit, wall/CPU seconds); the caller's side: working folder, uid slot, deadline.
- `_launcher.py` the isolation itself, in a fresh interpreter: network/mount/PID/IPC/UTS namespaces,
                 read-only host, private tmpfs, rlimits, privileges dropped to an unprivileged uid.
- `limits.py`    the rlimits of a program, and which limit stopped a run (`classify`).
- `cgroup.py`    the run's cgroup (v2 or v1): memory of the whole run (shared memory included) and
                 processes, and the counters that say which limit stopped it.
- `seccomp.py`   the seccomp filter of programs: no user namespaces of their own.
- `reward.py`    the code-execution reward (`reward.function=hpcrl.sandbox.reward:fraction_passed`
                 or `:all_passed`): the response's last ```python block against the sample's tests;
                 the paths every sandboxed program of a run hides.
- `asserts.py`   assert-style test cases judged in a process apart from the solution.

How each limit is enforced, what was tested and what is not protected: docs/agents.md.
"""

from hpcrl.sandbox.config import SandboxConfig
from hpcrl.sandbox.runner import (
    LIMITS,
    ProgramJob,
    Sandbox,
    SandboxResult,
    SandboxUnavailableError,
    default_python,
    run_program,
)

__all__ = ["LIMITS", "ProgramJob", "Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailableError",
           "default_python", "run_program"]
