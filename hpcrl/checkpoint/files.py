"""Durable file primitives for checkpoints: fsync'ed writes, atomic replacement, sha256 records.

Why fsync everywhere: a checkpoint is only worth something if it survives the node going down
right after the save returned (Slurm preemption kills jobs, nodes crash). A rename is only
durable once the directory holding it is fsync'ed, so directories are synced too. Nothing here
imports torch: the controller side and the CLI stay cheap to start.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any, TypedDict

CHUNK = 8 << 20
# errno values of "the storage takes no more bytes": out of space, over quota, a file over the limit
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# how writers that do not raise OSError say the same: safetensors (Rust) raises SafetensorError
# "... I/O error: No space left on device (os error 28)"
_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "file too large",
                  *(f"(os error {n})" for n in sorted(NO_SPACE_ERRNOS)))


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
    try:
        write_durable(tmp, data)
        os.replace(tmp, p)
    except BaseException:
        # a write that failed (disk full) must not leave its half-written sibling taking space
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer can still put on the file system of `path` (its nearest
    existing folder): statvfs f_bavail, which leaves out the blocks reserved for root."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def is_no_space(exc: BaseException | None) -> bool:
    """True if `exc`, or an exception it was raised from, says the storage is full (ENOSPC,
    EDQUOT, EFBIG as an OSError, or in the words of a writer that wraps its I/O errors)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if any(t in str(exc).lower() for t in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def format_bytes(n: int) -> str:
    """'12.3 MB (12345678 bytes)': readable, and exact for whoever compares with df -B1."""
    return f"{n / 1e6:.1f} MB ({n} bytes)"


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
