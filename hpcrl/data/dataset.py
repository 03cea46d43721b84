"""Prompt datasets in verl's schema: .parquet, .jsonl, or .json (JSON lines, or one JSON array).

A row holds `prompt` (chat messages, a list of {role, content}; the key is `data.prompt_key`),
`data_source` (picks the builtin reward rule), `reward_model.ground_truth`, and optionally `extra_info`
(handed to the reward function). The tokenizer's chat template is applied once, at load, with the
generation prompt, and prompts longer than `max_prompt_length` tokens are dropped (counted in
`num_filtered` and logged) so that rollout never sees a prompt it would have to cut.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("hpcrl.data")

SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass
class PromptRow:
    prompt_ids: list[int]
    prompt_text: str  # chat template applied
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any]
    index: int  # position in this dataset (what samplers hand out), after filtering


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file. `make data` writes the arithmetic sets into "
                                "data/arith; check data.train_files / data.val_files.")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        if path.suffix == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}: line {n} is not valid JSON ({e}).") from e
        for n, r in enumerate(rows):
            if not isinstance(r, dict):
                raise ValueError(f"{path}: row {n} is a {type(r).__name__}, expected a JSON object.")
        return rows
    raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}.")


def _messages(value: Any, path: Path, row: int, key: str) -> list[dict[str, str]]:
    if isinstance(value, str):  # a bare string is one user turn
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(f"{path}: row {row}: {key!r} must be chat messages, a non-empty list of "
                     f"{{'role': str, 'content': str}}; got {str(value)[:120]!r}.")


def _field(row: dict[str, Any], path: Path, n: int, key: str) -> Any:
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            raise ValueError(f"{path}: row {n} has no {key!r} (verl schema: {{prompt, data_source, "
                             "reward_model: {ground_truth}, extra_info}).")
        node = node[part]
    return node


class PromptDataset:
    """All prompts of `files`, tokenized with the chat template, in file order.

    `tokenizer` is a HuggingFace tokenizer with a chat template (or the path of one).
    """

    def __init__(self, files: list[str], tokenizer: Any, prompt_key: str = "prompt", max_prompt_length: int = 512):
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; the "
                             "prompts are chat messages. Use an instruct/chat tokenizer (model.tokenizer_path).")
        if not files:
            raise ValueError("data: no files given (data.train_files / data.val_files).")
        self.files = [str(f) for f in files]
        self.max_prompt_length = max_prompt_length
        messages: list[list[dict[str, str]]] = []
        meta: list[tuple[str, str, dict[str, Any]]] = []
        for f in self.files:
            path = Path(f)
            rows = _read_rows(path)
            for n, row in enumerate(rows):
                msgs = _messages(_field(row, path, n, prompt_key), path, n, prompt_key)
                source = str(_field(row, path, n, "data_source"))
                truth = _field(row, path, n, "reward_model.ground_truth")
                extra = row.get("extra_info") or {}
                if not isinstance(extra, dict):
                    raise ValueError(f"{path}: row {n}: 'extra_info' must be an object, got {type(extra).__name__}.")
                messages.append(msgs)
                meta.append((source, truth if isinstance(truth, str) else json.dumps(truth), extra))
        if not messages:
            raise ValueError(f"data: {', '.join(self.files)} hold no rows.")
        texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        keep = [i for i, x in enumerate(ids) if len(x) <= max_prompt_length]
        self.num_filtered = len(ids) - len(keep)
        self._ids = [list(ids[i]) for i in keep]
        self._texts = [texts[i] for i in keep]
        self._meta = [meta[i] for i in keep]
        if not keep:
            longest = max(len(x) for x in ids)
            raise ValueError(f"data: all {len(ids)} prompts of {', '.join(self.files)} are longer than "
                             f"data.max_prompt_length={max_prompt_length} tokens (shortest "
                             f"{min(len(x) for x in ids)}, longest {longest}); raise data.max_prompt_length.")
        level = logging.WARNING if self.num_filtered else logging.INFO
        log.log(level, "data: %d prompts from %s; %d filtered out (longer than max_prompt_length=%d tokens)",
                len(keep), ", ".join(self.files), self.num_filtered, max_prompt_length)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> PromptRow:
        if not 0 <= i < len(self._ids):
            raise IndexError(f"prompt index {i} out of range for a dataset of {len(self._ids)} rows")
        source, truth, extra = self._meta[i]
        return PromptRow(prompt_ids=list(self._ids[i]), prompt_text=self._texts[i], data_source=source,
                         ground_truth=truth, extra_info=dict(extra), index=i)
