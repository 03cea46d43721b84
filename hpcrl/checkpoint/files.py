"""Durable file primitives for checkpoints: fsync'ed writes, atomic replacement, sha256 records.

Why fsync everywhere: a checkpoint is only worth something if it survives the node going down
right after the save returned (Slurm preemption kills jobs, nodes crash). A rename is only
durable once the directory holding it is fsync'ed, so directories are synced too. Nothing here
imports torch: the controller side and the CLI stay cheap to start.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, TypedDict

CHUNK = 8 << 20


class FileRecord(TypedDict):
    """One file of a checkpoint, as listed in its manifest: path relative to the checkpoint folder."""

    path: str
    size: int
    sha256: str


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks (hashlib releases the GIL on large updates)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: str | Path) -> None:
    """Flush a file's data to stable storage (an fd opened read-only may be fsync'ed on POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make the entries of a directory (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_record(path: str | Path, root: str | Path) -> FileRecord:
    """Size and sha256 of `path`, named relative to the checkpoint folder `root`."""
    p = Path(path)
    return {"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}


def write_durable(path: str | Path, data: bytes | str) -> None:
    """Write a whole file and fsync it (not its directory: callers sync a folder once at the end)."""
    raw = data.encode() if isinstance(data, str) else data
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def replace_atomic(path: str | Path, data: bytes | str) -> None:
    """Replace `path` so that a reader sees the old or the new content, never a mix, even across
    a crash: write a temporary sibling, fsync it, os.replace it over the target, fsync the folder."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    write_durable(tmp, data)
    os.replace(tmp, p)
    fsync_dir(p.parent)


def records_by_path(records: Any) -> dict[str, FileRecord]:
    """Flatten worker results (a list per rank, possibly nested, None for ranks that wrote nothing)
    into {path: record}; the same path twice must describe the same bytes."""
    out: dict[str, FileRecord] = {}

    def visit(x: Any) -> None:
        if x is None:
            return
        if isinstance(x, dict):
            path = x["path"]
            rec: FileRecord = {"path": path, "size": int(x["size"]), "sha256": str(x["sha256"])}
            if path in out and out[path] != rec:
                raise ValueError(f"{path}: two different records for one file ({out[path]} vs {rec})")
            out[path] = rec
            return
        for item in x:
            visit(item)

    visit(records)
    return out
