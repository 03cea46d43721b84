"""Prompt data for the RL loop: verl-schema datasets with the chat template applied, and a resumable
shuffled batch sampler.

The controller loads `PromptDataset(cfg.data.train_files, tokenizer, ...)`, draws each step's prompts
with `ShuffledSampler.next_batch()`, saves `state_dict()` in checkpoints, and walks validation sets
with `iterate_batches`.
"""

from hpcrl.data.dataset import PromptDataset, PromptRow, RowScan, scan_rows
from hpcrl.data.sampler import ShuffledSampler, iterate_batches

__all__ = ["PromptDataset", "PromptRow", "RowScan", "ShuffledSampler", "iterate_batches", "scan_rows"]
