"""The cyclic garbage collector paused while a worker builds a role object (where megatron-core and vLLM are
imported and the models loaded).

Why: building a colocated actor imports megatron-core and vLLM (most of the ~750,000 objects a worker keeps
until it exits) and loads both models. Every few hundred allocations the collector walks the young objects,
and the old generation again and again as it grows, looking for cycles that start-up hardly makes. Measured
on a 2-step tiny GRPO run (4 workers, 2-core AMD EPYC, 2026-12-07, `gc.callbacks` timing each pass): a
worker spent 5.6 s of CPU in the collector, 2.9 s with this pause and the freeze before vLLM's engine is
built (hpcrl/engines/vllm/engine.py); with `hpcrl run` no longer importing torch, the run took 72-76 CPU-s
instead of 80-83. vLLM makes the same trade once its engine is built (`freeze_gc_heap`), and
launchers/hpcrl_entry.py's `_leave` at exit.

The cost: cycles made during the build are collected only after it (by the next passes, or by vLLM's
engine shutdown when the freeze pinned them): the workers' resident memory was ~15 MB higher in that run
(~850 MB instead of ~835 MB).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Turn the cyclic garbage collector off inside the block; back on after it if it was on before."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
