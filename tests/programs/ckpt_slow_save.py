"""One checkpoint save of a large shard, for the kill -9 tests in tests/test_checkpoint.py.

    python tests/programs/ckpt_slow_save.py ROOT STEP MEGABYTES

Plays one worker and the controller: begin(STEP), write a MEGABYTES shard file in 1 MB chunks
(fsync every 8 MB, as a durable writer streaming a big tensor does), record it, then commit with
full checksum verification (re-reads the whole file, so the commit itself takes a while). The
test SIGKILLs it at some point of that and checks what `latest_valid` picks. No torch: it starts
in a fraction of a second.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcrl.checkpoint.files import file_record, fsync_dir  # noqa: E402
from hpcrl.checkpoint.store import CheckpointStore  # noqa: E402


def main() -> None:
    root, step, megabytes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = CheckpointStore(root, keep_last=100)
    tmp = store.begin(step)
    print(f"begin {tmp}", flush=True)
    shard = tmp / "actor" / "pp0_tp0.safetensors"
    shard.parent.mkdir()
    chunk = bytes(range(256)) * 4096  # 1 MB
    with open(shard, "wb") as f:
        for i in range(megabytes):
            f.write(chunk)
            if i % 8 == 7:
                f.flush()
                os.fsync(f.fileno())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(shard.parent)
    print("written", flush=True)
    store.commit(tmp, step, [[file_record(shard, tmp)]], {"step": step}, "trainer:\n  seed: 1\n",
                 verify_checksums=True)
    print("committed", flush=True)


if __name__ == "__main__":
    main()
