"""The controller's view of a run's checkpoints: atomic commit, manifest, `latest`, retention.

Layout of `root` (usually RUN_DIR/checkpoints)::

    latest                        one line: the folder name of the newest committed checkpoint
    step_00000010/                a committed checkpoint (only commit() creates these names)
        manifest.json             written last: every other file with its size and sha256
        controller_state.json     algorithm state of rank 0 (sampler, KL controller, counters, ...)
        config.yaml               the resolved config of the run
        actor/pp0_tp0.safetensors, actor/pp0_tp0.json, ...   (hpcrl.checkpoint.megatron_state)
        rng/rank0.pt, ...
    .tmp-step_00000015-<hex>/     a save in progress, or the debris of one that died

Why a save cannot be half-visible: the workers and the controller write into a temporary folder,
every file is fsync'ed, the manifest is written last and checked against the files, and only then
is the folder renamed to its step name (a rename within one file system is atomic; the parent is
fsync'ed) and `latest` replaced (temp file + os.replace). A kill -9 at any point leaves either the
previous state or the new, complete checkpoint; `latest_valid` additionally refuses any folder
whose manifest is missing or does not match the files (disk corruption, a hand-made folder).

A full disk (or quota) is the same case seen from the other side: `check_space` refuses a save
that cannot fit before anything is written; a write that still runs out of space (someone else
filled the disk meanwhile) raises `DiskFullError` naming the file and the bytes, and the partial
save is removed (`abandon`), so its space comes back and `latest` keeps naming the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.checkpoint.files import (
    file_record,
    format_bytes,
    free_bytes,
    fsync_dir,
    is_no_space,
    records_by_path,
    replace_atomic,
    sha256_file,
    write_durable,
)

log = logging.getLogger("hpcrl.checkpoint")

FORMAT = "hpcrl-checkpoint/1"
MANIFEST = "manifest.json"
CONTROLLER_STATE = "controller_state.json"
CONFIG = "config.yaml"
LATEST = "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")
TMP_RE = re.compile(r"^\.tmp-step_(\d{8,})-[0-9a-f]+$")
TRASH_PREFIX = ".trash-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be committed (its files do not match what the writers reported)."""


class DiskFullError(CheckpointError):
    """A checkpoint did not fit: its file system is out of space or quota. The message names the
    path, the bytes the save needs and the bytes free."""


def no_space_error(path: str | Path, what: str, nbytes: int) -> DiskFullError:
    """The error of a writer (worker or controller) whose write of `path` ran out of space."""
    return DiskFullError(f"no space left writing {path} ({what}, ~{format_bytes(nbytes)}): "
                         f"{format_bytes(free_bytes(Path(path).parent))} free on its file system")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class CheckpointInfo:
    """One committed checkpoint folder as `list()` sees it (sizes checked, checksums not)."""

    step: int
    path: Path
    created: float | None
    size: int
    valid: bool
    latest: bool
    problems: list[str] = field(default_factory=list)


class CheckpointStore:
    """Checkpoints of one run under `root`. keep_last: how many of the newest to keep; keep_every:
    also keep every checkpoint whose step is a multiple of it (0: none)."""

    def __init__(self, root: str | Path, keep_last: int = 2, keep_every: int = 0) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0, got {keep_every}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every

    # saving ------------------------------------------------------------------------------------
    def free_bytes(self) -> int:
        """Bytes still free for a save on the file system of `root`."""
        self.root.mkdir(parents=True, exist_ok=True)
        return free_bytes(self.root)

    def check_space(self, step: int, needed: int) -> None:
        """Refuse, before anything is written, a save of `needed` bytes that cannot fit: a save
        that runs out of space half-way costs the time to write it and leaves debris to clean.
        `needed` is everything every writer will put into the folder (all ranks together: they
        share this file system); the previous checkpoints stay until the new one is committed."""
        free = self.free_bytes()
        if needed > free:
            sizes = [i.size for i in self.list()]
            kept = (f"; the {len(sizes)} checkpoint(s) kept there take {format_bytes(sum(sizes))} "
                    "(checkpoint.keep_last)") if sizes else ""
            raise DiskFullError(f"checkpoint of step {step} needs ~{format_bytes(needed)} in {self.root}, only "
                                f"{format_bytes(free)} free{kept}: nothing was written, {self._intact()}. Free "
                                "space there, keep fewer checkpoints or move checkpoint.dir")

    def abandon(self, tmp: str | Path) -> None:
        """Remove the temporary folder of a save that failed (its space comes back now, not at the
        next commit). Only a `.tmp-*` folder of this store is ever removed."""
        tmp = Path(tmp)
        if tmp.parent.resolve() == self.root.resolve() and TMP_RE.match(tmp.name):
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed %s: the partial files of a save that failed", tmp.name)

    def _intact(self) -> str:
        latest = self.read_latest()
        return (f"the previous checkpoint {self.root / latest} is intact and is the one a resume uses"
                if latest else "there is no previous checkpoint")

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for the save of `step`; give it to the workers' save_checkpoint."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{step_name(step)}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: str | Path, step: int, records: Any, controller_state: dict[str, Any], config_yaml: str,
               verify_checksums: bool = False) -> Path:
        """Seal the save in `tmp` as the checkpoint of `step` and point `latest` at it.

        records: the file records the workers returned (any nesting of lists, None for ranks that
        wrote nothing). Every file under `tmp` must be recorded, and every record must match its
        file's size (and sha256 with verify_checksums: this re-reads everything on the controller,
        so it is off by default; the writers hashed what they fsync'ed). Then retention runs."""
        tmp = Path(tmp)
        m = TMP_RE.match(tmp.name)
        if tmp.parent.resolve() != self.root.resolve() or not m or int(m.group(1)) != step:
            raise CheckpointError(f"{tmp} is not a temporary folder of step {step} under {self.root} (use begin())")
        t0 = time.monotonic()
        files = records_by_path(records)
        writing = tmp  # the file being written when the storage runs out of space
        final = self.root / step_name(step)
        try:
            for name, data in ((CONTROLLER_STATE, json.dumps(controller_state, indent=1, sort_keys=True)),
                               (CONFIG, config_yaml)):
                writing = tmp / name
                write_durable(writing, data)
                files[name] = file_record(writing, tmp)
            on_disk = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()}
            unrecorded, missing = on_disk - files.keys(), files.keys() - on_disk
            if unrecorded or missing:
                raise CheckpointError(f"{tmp}: files without a record {sorted(unrecorded)[:5]}, records without a "
                                      f"file {sorted(missing)[:5]}")
            for d in sorted({(tmp / p).parent for p in files}, key=lambda x: len(x.parts), reverse=True):
                fsync_dir(d)
            manifest = {"format": FORMAT, "step": step, "created": time.time(),
                        "total_bytes": sum(r["size"] for r in files.values()),
                        "files": {p: {"size": r["size"], "sha256": r["sha256"]} for p, r in sorted(files.items())}}
            writing = tmp / MANIFEST
            write_durable(writing, json.dumps(manifest, indent=1))
            fsync_dir(tmp)
            problems = self.verify(tmp, checksums=verify_checksums)
            if problems:
                raise CheckpointError(f"{tmp}: the save does not match its manifest: " + "; ".join(problems[:5]))
            if final.exists():  # the same step saved again (a run resumed from an older checkpoint)
                self._trash(final)
            writing = final
            os.rename(tmp, final)
        except OSError as e:
            if not is_no_space(e):
                raise
            self.abandon(tmp)
            raise self._full_at_commit(step, writing, files, e) from e
        try:
            fsync_dir(self.root)
            replace_atomic(self.root / LATEST, final.name + "\n")
        except OSError as e:
            if not is_no_space(e):
                raise
            # the new folder is complete, but `latest` still names the previous checkpoint: take
            # the new one away as well, so that the state is exactly the one before this save
            # (which the error says is what a resume uses) and its space comes back
            self._trash(final)
            self._empty_trash()
            raise self._full_at_commit(step, self.root / LATEST, files, e) from e
        removed = self.prune()
        self._clean_debris(step)
        log.info("checkpoint %s committed: %d files, %.1f MB, %.2f s; pruned %s", final.name, len(files),
                 manifest["total_bytes"] / 1e6, time.monotonic() - t0, [p.name for p in removed] or "nothing")
        return final

    def _full_at_commit(self, step: int, writing: Path, files: dict[str, Any], exc: OSError) -> DiskFullError:
        needed = sum(r["size"] for r in files.values())
        return DiskFullError(f"checkpoint of step {step} does not fit in {self.root}: {exc.strerror or exc} writing "
                             f"{writing}; the save needs ~{format_bytes(needed)}, {format_bytes(self.free_bytes())} "
                             f"are free with its partial files removed; {self._intact()}")

    def prune(self) -> list[Path]:
        """Delete committed checkpoints beyond the last keep_last, except every keep_every-th step
        and the one `latest` points to. Returns what was deleted."""
        steps = self._step_folders()
        keep = {s for s, _ in steps[-self.keep_last:]}
        if self.keep_every:
            keep |= {s for s, _ in steps if s % self.keep_every == 0}
        pointed = self.read_latest()
        removed = []
        for s, path in steps:
            if s not in keep and path.name != pointed:
                self._trash(path)
                removed.append(path)
        self._empty_trash()
        return removed

    def _trash(self, path: Path) -> None:
        """Take a folder out of the checkpoint namespace atomically; deleting it may take a while
        and a kill during the delete must not leave a half-deleted folder under a step name."""
        os.rename(path, self.root / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
        fsync_dir(self.root)

    def _empty_trash(self) -> None:
        for p in self.root.glob(f"{TRASH_PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)

    def _clean_debris(self, step: int) -> None:
        """Remove temporary folders of saves that died at or before `step` (a save in flight for
        a later step is left alone)."""
        for p in self.root.iterdir():
            m = TMP_RE.match(p.name)
            if m and int(m.group(1)) <= step:
                log.warning("removing %s: the debris of a save that did not finish", p.name)
                shutil.rmtree(p, ignore_errors=True)

    # finding -----------------------------------------------------------------------------------
    def _step_folders(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))]
        return sorted(found)

    def read_latest(self) -> str | None:
        """The folder name `latest` holds, or None without a (readable) pointer."""
        try:
            name = (self.root / LATEST).read_text().strip()
        except OSError:
            return None
        return name or None

    def latest_valid(self, verify_checksums: bool = False) -> Path | None:
        """The checkpoint to resume from: the one `latest` points to if it verifies, else the newest
        committed folder that does. Every folder passed over is logged with its problem."""
        tried: set[str] = set()
        pointed = self.read_latest()
        if pointed is not None:
            tried.add(pointed)
            if STEP_RE.match(pointed) and (self.root / pointed).is_dir():
                problems = self.verify(self.root / pointed, checksums=verify_checksums)
                if not problems:
                    return self.root / pointed
                log.warning("checkpoint %s (latest) is unusable, skipped: %s", pointed, "; ".join(problems))
            else:
                log.warning("%s names %r, which is not a checkpoint folder", self.root / LATEST, pointed)
        for _, path in reversed(self._step_folders()):
            if path.name in tried:
                continue
            problems = self.verify(path, checksums=verify_checksums)
            if not problems:
                log.warning("resuming from %s instead of the latest pointer (%s)", path.name, pointed)
                return path
            log.warning("checkpoint %s is unusable, skipped: %s", path.name, "; ".join(problems))
        return None

    def list(self) -> list[CheckpointInfo]:
        """Every committed folder, oldest first; validity by manifest and sizes (cheap)."""
        pointed = self.read_latest()
        out = []
        for step, path in self._step_folders():
            problems = self.verify(path, checksums=False)
            manifest = _read_manifest(path)
            size = (sum(r["size"] for r in manifest["files"].values()) if isinstance(manifest, dict) else
                    sum(p.stat().st_size for p in path.rglob("*") if p.is_file()))
            out.append(CheckpointInfo(step=step, path=path, created=manifest.get("created") if isinstance(
                manifest, dict) else None, size=size, valid=not problems, latest=path.name == pointed,
                problems=problems))
        return out

    def verify(self, path: str | Path, checksums: bool = True) -> list[str]:
        """Problems of one checkpoint folder (empty: it is complete). Checks that the manifest
        exists and parses, that it lists the controller's files, and that every listed file exists
        with its size and (checksums=True) its sha256."""
        path = Path(path)
        manifest = _read_manifest(path)
        if isinstance(manifest, str):
            return [manifest]
        problems = []
        files: dict[str, dict[str, Any]] = manifest.get("files", {})
        for required in (CONTROLLER_STATE, CONFIG):
            if required not in files:
                problems.append(f"{required} is not in the manifest")
        for rel, rec in files.items():
            f = path / rel
            try:
                size = f.stat().st_size
            except OSError:
                problems.append(f"{rel}: missing")
                continue
            if size != rec["size"]:
                problems.append(f"{rel}: {size} bytes, the manifest says {rec['size']} (truncated or partial)")
            elif checksums and sha256_file(f) != rec["sha256"]:
                problems.append(f"{rel}: sha256 differs from the manifest (corrupt)")
        return problems

    def load_controller_state(self, path: str | Path) -> dict[str, Any]:
        return json.loads((Path(path) / CONTROLLER_STATE).read_text())

    def manifest(self, path: str | Path) -> dict[str, Any]:
        m = _read_manifest(Path(path))
        if isinstance(m, str):
            raise CheckpointError(m)
        return m

    def find(self, step: int) -> Path | None:
        """The committed folder of `step`, if any."""
        path = self.root / step_name(step)
        return path if path.is_dir() else None


def _read_manifest(path: Path) -> dict[str, Any] | str:
    """The parsed manifest, or a string saying why there is none."""
    try:
        raw = (path / MANIFEST).read_text()
    except FileNotFoundError:
        return f"{MANIFEST} missing (an incomplete save)"
    except OSError as e:
        return f"{MANIFEST} unreadable: {e}"
    try:
        m = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"{MANIFEST} is not valid JSON ({e})"
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        return f"{MANIFEST} is not an {FORMAT} manifest"
    return m

