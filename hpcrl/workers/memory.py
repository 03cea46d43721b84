"""Peak memory of a worker process, per step: what `memory/*` metrics report.

On Linux the kernel keeps the resident set's high-water mark (VmHWM in /proc/self/status) and
resets it when "5" is written to /proc/self/clear_refs, so each step reads the peak of that step
alone. On GPU, torch's allocator peaks (allocated and reserved) are read and reset likewise.
`return_free_heap` hands the C heap's freed pages back between phases (what a worker does before
every reshard).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch


def _vm_hwm_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def peak_memory(reset: bool = True) -> dict[str, float]:
    """GB at the peak since the last reset (or the process start): rss (resident set), and on GPU
    cuda_allocated / cuda_reserved. With reset, the next call measures from now."""
    out: dict[str, float] = {}
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        out["rss_gb"] = hwm / 1e9
        if reset:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:  # not permitted here: the peak is then the process's lifetime peak
                pass
    if torch.cuda.is_available():
        out["cuda_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["cuda_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        if reset:
            torch.cuda.reset_peak_memory_stats()
    return out


_malloc_trim = None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def return_free_heap() -> int:
    """Hand the heap's free pages back to the kernel; the bytes the resident set shrank by (0 where
    the C library is not glibc).

    Why: glibc serves blocks below its mmap threshold (which rises to 32 MB as big tensors are freed)
    from its heaps and keeps them resident after `free`, for reuse. Between phases that reuse rarely
    comes: the update's activations, freed, stay resident while the reshard wakes vLLM's weights, and
    the two add up to the step's peak. malloc_trim(0) releases every whole free page of every arena
    (madvise), so the next phase touches fresh pages only where it writes."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
            _malloc_trim = libc.malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if not _malloc_trim:
        return 0
    before = _rss_bytes()
    _malloc_trim(0)
    return max(0, before - _rss_bytes())
