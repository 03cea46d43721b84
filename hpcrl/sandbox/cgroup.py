"""One cgroup per sandboxed run: memory (shared memory, memfd and tmpfs pages included) and processes
counted for the run as a whole, and the counters that say which limit stopped it.

cgroup v2 where memory and pids are delegated to the caller's cgroup (its `cgroup.subtree_control`
has them, or they can be enabled there), else cgroup v1 (the memory and pids hierarchies, e.g. a
hybrid layout). v1's memory controller charges a shmem/tmpfs/memfd page to the cgroup of the process
that first touches it, v2's likewise, so a hoard of memfds or SysV segments counts against the run.

The caller (runner.py) makes the folders and writes the limits before the launcher starts; the
launcher opens each attach file (`RunCgroup.attach_files`) before it leaves the host's mount namespace and the program's
process writes itself into them (so init, which must live to report, stays outside the limit). The
caller reads the counters and removes the folders after the run. Folders of a killed caller carry its
pid in their name and are removed by the next `Sandbox` of the machine (`sweep_stale`).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from dataclasses import dataclass

PREFIX = "hpcrl-sbx-"
_counter = itertools.count()
_counter_lock = threading.Lock()


@dataclass(frozen=True)
class CgroupLayout:
    """Where this process makes run cgroups: v2 (one folder) or v1 (a memory and a pids folder)."""

    version: int
    memory_parent: str
    pids_parent: str


def _mount_points() -> tuple[str | None, dict[str, tuple[str, str]]]:
    """(cgroup2 mount point, {v1 controller: (mount point, root inside the hierarchy)})."""
    v2, v1 = None, {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if not rfields:
                continue
            if rfields[0] == "cgroup2" and v2 is None:
                v2 = fields[4]
            elif rfields[0] == "cgroup":
                for opt in rfields[-1].split(","):
                    if opt in ("memory", "pids"):
                        v1[opt] = (fields[4], fields[3])
    return v2, v1


def _own_paths() -> tuple[str | None, dict[str, str]]:
    """This process's cgroup: (v2 path, {v1 controller: path})."""
    v2, v1 = None, {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                v2 = path
            for c in controllers.split(","):
                if c in ("memory", "pids"):
                    v1[c] = path
    return v2, v1


def _join(mount: str, root: str, path: str) -> str | None:
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None  # our cgroup is outside what is mounted here
    rel = path[len(root):] if root != "/" else path
    return os.path.join(mount, rel.lstrip("/"))


def _probe(parents: list[str], limit_files: list[str]) -> None:
    """Make and remove a child in each parent, writing one limit file: raises OSError if that fails."""
    name = f"{PREFIX}probe-{os.getpid()}"
    made = []
    try:
        for parent, limit in zip(parents, limit_files):
            d = os.path.join(parent, name)
            os.mkdir(d)
            made.append(d)
            with open(os.path.join(d, limit), "w") as f:
                f.write("max" if limit.endswith(".max") else "-1")
    finally:
        for d in made:
            _rmdir(d, wait_s=1.0)


def _v2_layout(mount: str, path: str) -> CgroupLayout | None:
    own = os.path.join(mount, path.lstrip("/"))
    try:
        with open(os.path.join(own, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        if not {"memory", "pids"} <= enabled:
            # allowed only where the cgroup holds no process (the root, or a delegated empty parent)
            with open(os.path.join(own, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
        _probe([own], ["memory.max"])
    except OSError:
        return None
    return CgroupLayout(2, own, own)


def _v1_layout(v1_mounts: dict[str, tuple[str, str]], v1_paths: dict[str, str]) -> CgroupLayout | None:
    if not {"memory", "pids"} <= set(v1_mounts) or not {"memory", "pids"} <= set(v1_paths):
        return None
    memory = _join(*v1_mounts["memory"], v1_paths["memory"])
    pids = _join(*v1_mounts["pids"], v1_paths["pids"])
    if memory is None or pids is None:
        return None
    try:
        _probe([memory, pids], ["memory.limit_in_bytes", "pids.max"])
    except OSError:
        return None
    return CgroupLayout(1, memory, pids)


@functools.lru_cache(maxsize=1)
def layout() -> tuple[CgroupLayout | None, str]:
    """The layout this process can use (cached), or None with the reason."""
    try:
        v2_mount, v1_mounts = _mount_points()
        v2_path, v1_paths = _own_paths()
    except OSError as e:
        return None, f"cannot read the cgroup setup ({e})"
    if v2_mount is not None and v2_path is not None:
        found = _v2_layout(v2_mount, v2_path)
        if found is not None:
            return found, ""
    found = _v1_layout(v1_mounts, v1_paths)
    if found is not None:
        return found, ""
    where = (f"cgroup v2 at {v2_mount} (this process in {v2_path}) does not delegate memory and pids"
             if v2_mount else "no cgroup v2 mount")
    v1 = ("cgroup v1 memory/pids folders of this process cannot be written" if {"memory", "pids"} <= set(v1_mounts)
          else "no cgroup v1 memory and pids hierarchies")
    return None, f"{where}; {v1}"


def _rmdir(path: str, wait_s: float) -> bool:
    """Remove a cgroup folder; its last processes may still be exiting (EBUSY) for a moment."""
    end = time.monotonic() + wait_s
    delay = 0.001
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _read_keyed(path: str) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().lstrip("-").isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class RunCgroup:
    """The cgroup(s) of one run. memory_bytes / max_processes None: counted, not limited."""

    def __init__(self, lay: CgroupLayout, memory_bytes: int | None, max_processes: int | None):
        self.layout = lay
        with _counter_lock:
            n = next(_counter)
        name = f"{PREFIX}{os.getpid()}-{n}"
        self.dirs = [os.path.join(lay.memory_parent, name)]
        if lay.version == 1:
            self.dirs.append(os.path.join(lay.pids_parent, name))
        made = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            mem, pids = self.dirs[0], self.dirs[-1]
            if lay.version == 2:
                if memory_bytes is not None:
                    _write(os.path.join(mem, "memory.max"), str(memory_bytes))
                    if os.path.exists(os.path.join(mem, "memory.swap.max")):
                        _write(os.path.join(mem, "memory.swap.max"), "0")
                    # an OOM kill ends the whole run, not one process of it
                    if os.path.exists(os.path.join(mem, "memory.oom.group")):
                        _write(os.path.join(mem, "memory.oom.group"), "1")
            elif memory_bytes is not None:
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                memsw = os.path.join(mem, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # swap accounting on: swapped-out pages count too
                    _write(memsw, str(memory_bytes))
            if max_processes is not None:
                _write(os.path.join(pids, "pids.max"), str(max_processes))
        except OSError:
            for d in reversed(made):
                _rmdir(d, wait_s=0.5)
            raise

    @property
    def attach_files(self) -> list[str]:
        """The files a process writes "0" to, to move itself in. v1: `tasks`, which moves the writing
        thread only (the program's process has one thread then) without the kernel's global
        threadgroup lock: writing cgroup.procs waits for an RCU grace period, measured 10-13 ms a run
        here against 0.03 ms. v2: cgroup.procs (a domain cgroup takes whole processes)."""
        name = "tasks" if self.layout.version == 1 else "cgroup.procs"
        return [os.path.join(d, name) for d in self.dirs]

    def usage(self) -> dict[str, float]:
        """Counters of the run: memory_limit_hits (the usage reached the limit), oom_kills,
        processes_limit_hits (a fork refused at pids.max), peak_memory_mb."""
        mem, pids = self.dirs[0], self.dirs[-1]
        if self.layout.version == 2:
            events = _read_keyed(os.path.join(mem, "memory.events"))
            hits, ooms = events.get("max", 0), events.get("oom_kill", 0)
            peak = _read_int(os.path.join(mem, "memory.peak"))
        else:
            hits = _read_int(os.path.join(mem, "memory.failcnt"))
            ooms = _read_keyed(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
            peak = _read_int(os.path.join(mem, "memory.max_usage_in_bytes"))
        return {"memory_limit_hits": float(hits), "oom_kills": float(ooms),
                "processes_limit_hits": float(_read_keyed(os.path.join(pids, "pids.events")).get("max", 0)),
                "peak_memory_mb": peak / (1 << 20)}

    def remove(self) -> None:
        for d in self.dirs:
            _rmdir(d, wait_s=2.0)


def sweep_stale() -> None:
    """Remove run cgroups of processes that no longer exist (a caller killed mid-run)."""
    lay, _ = layout()
    if lay is None:
        return
    for parent in dict.fromkeys((lay.memory_parent, lay.pids_parent)):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(PREFIX):
                continue
            try:
                pid = int(name[len(PREFIX):].split("-", 1)[0])
            except ValueError:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                _rmdir(os.path.join(parent, name), wait_s=0.0)
            except PermissionError:
                pass
