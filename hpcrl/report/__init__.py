"""What a run looks like to the people watching it, read from the files the trainer writes.

- `plots`: `hpcrl plot RUN_DIR` draws metrics.jsonl and validation.jsonl as PNGs (rewards and
  accuracy, lengths, KL and entropy, seconds per phase, memory per worker).

Nothing here talks to workers or Slurm: a finished, running or preempted run directory is enough.
"""
