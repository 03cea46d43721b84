"""Data for the training loops: verl-schema prompt datasets (RL) and preference pairs (DPO), with the
chat template applied, and a resumable shuffled batch sampler.

The controller loads `PromptDataset(cfg.data.train_files, tokenizer, ...)` (or `PreferenceDataset`),
draws each step's rows with `ShuffledSampler.next_batch()`, saves `state_dict()` in checkpoints, and
walks validation sets with `iterate_batches`.
"""

from hpcrl.data.dataset import PromptDataset, PromptRow, RowScan, scan_rows
from hpcrl.data.preference import PreferenceDataset, PreferencePair, PreferenceScan, scan_preference_rows
from hpcrl.data.sampler import ShuffledSampler, iterate_batches

__all__ = ["PreferenceDataset", "PreferencePair", "PreferenceScan", "PromptDataset", "PromptRow", "RowScan",
           "ShuffledSampler", "iterate_batches", "scan_preference_rows", "scan_rows"]
