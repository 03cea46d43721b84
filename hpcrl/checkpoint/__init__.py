"""Distributed checkpoints: workers write their own shards, the controller commits atomically.

`store` (controller: temp folder, manifest, `latest`, retention; no torch), `megatron_state`
(workers: Megatron shard + optimizer + RNG, loads into the same or another layout), `export`
(offline: a checkpoint's role as a HF folder), `compat` (which config may resume a checkpoint: the
run's identity fixed, its allocation and layout free). See docs/checkpoint.md.
"""

from hpcrl.checkpoint.store import CheckpointError, CheckpointInfo, CheckpointStore, DiskFullError

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointStore", "DiskFullError"]
