"""Peak memory of a worker process, per step: what `memory/*` metrics report.

On Linux the kernel keeps the resident set's high-water mark (VmHWM in /proc/self/status) and
resets it when "5" is written to /proc/self/clear_refs, so each step reads the peak of that step
alone. On GPU, torch's allocator peaks (allocated and reserved) are read and reset likewise.
"""

from __future__ import annotations

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
