"""Prompt datasets in verl's schema: .parquet, .jsonl, or .json (JSON lines, or one JSON array).

A row holds `prompt` (chat messages, a list of {role, content}; the key is `data.prompt_key`),
`data_source` (picks the builtin reward rule), `reward_model.ground_truth`, and optionally `extra_info`
(handed to the reward function). The tokenizer's chat template is applied once, at load, with the
generation prompt, and prompts longer than `max_prompt_length` tokens are dropped (counted in
`num_filtered` and logged) so that rollout never sees a prompt it would have to cut. `scan_rows`
checks a file row by row without tokenizing (the config check runs it before a run starts): rows
that do not fit the schema are skipped and named, up to a share of the file.
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


def _records(path: Path) -> tuple[list[tuple[int, Any]], list[str]]:
    """(row number, record) of every record of a data file, and a problem for each line of a JSON-lines
    file that cannot be one (not UTF-8, not JSON). A missing file, an unknown type or a broken JSON
    array is a whole-file error (raised)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file. `make data` writes the arithmetic sets into "
                                "data/arith; check data.train_files / data.val_files.")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist())), []
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}.")
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip().startswith(b"["):
        try:
            return list(enumerate(json.loads(data))), []
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON array ({e}).") from e
    records: list[tuple[int, Any]] = []
    problems: list[str] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            records.append((len(records) + len(problems), json.loads(raw.decode("utf-8"))))
        except UnicodeDecodeError as e:
            problems.append(f"{path}: line {n} is not valid UTF-8 ({e}).")
        except json.JSONDecodeError as e:
            problems.append(f"{path}: line {n} is not valid JSON ({e}).")
    return records, problems


@dataclass
class RowScan:
    """A data file checked row by row: the usable rows and one problem for each unusable one."""

    path: Path
    # (row number, chat messages, data_source, ground truth, extra_info) of each usable row
    rows: list[tuple[int, list[dict[str, str]], str, str, dict[str, Any]]]
    problems: list[str]

    @property
    def total(self) -> int:
        return len(self.rows) + len(self.problems)

    def sources(self) -> dict[str, list[int]]:
        """The row numbers of each data_source."""
        out: dict[str, list[int]] = {}
        for n, _, source, _, _ in self.rows:
            out.setdefault(source, []).append(n)
        return out

    def first_problems(self, n: int = 5) -> str:
        return " ".join(self.problems[:n]) + (" ..." if len(self.problems) > n else "")

    def refusal(self, max_skipped_share: float) -> str | None:
        """Why the file is refused (more unusable rows than the share allows), or None."""
        if not self.problems or len(self.problems) <= max_skipped_share * self.total:
            return None
        return (f"{len(self.problems)} of {self.total} rows unusable ({len(self.problems) / self.total:.1%}; "
                f"data.max_skipped_row_share={max_skipped_share:g}): {self.first_problems()}")

    def accept(self, max_skipped_share: float, name: str | Path) -> int:
        """ValueError naming the file (`name`, as the config gave it) when it is refused; else log the
        skipped rows (if any) and return how many there are."""
        refusal = self.refusal(max_skipped_share)
        if refusal:
            raise ValueError(f"{name}: {refusal}")
        if self.problems:
            log.warning("data: %s: skipped %d of %d rows (data.max_skipped_row_share=%g): %s", name,
                        len(self.problems), self.total, max_skipped_share, self.first_problems())
        return len(self.problems)


def scan_rows(path: str | Path, prompt_key: str = "prompt") -> RowScan:
    """Read a data file and check each row against the schema (no tokenizing)."""
    path = Path(path)
    records, problems = _records(path)
    rows = []
    for n, row in records:
        try:
            if not isinstance(row, dict):
                raise ValueError(f"{path}: row {n} is a {type(row).__name__}, expected a JSON object.")
            msgs = _messages(_field(row, path, n, prompt_key), path, n, prompt_key)
            source = str(_field(row, path, n, "data_source"))
            truth = _field(row, path, n, "reward_model.ground_truth")
            if truth in ("", [], {}) or (isinstance(truth, str) and not truth.strip()):
                raise ValueError(f"{path}: row {n}: 'reward_model.ground_truth' is empty.")
            extra = row.get("extra_info") or {}
            if not isinstance(extra, dict):
                raise ValueError(f"{path}: row {n}: 'extra_info' must be an object, got {type(extra).__name__}.")
        except ValueError as e:
            problems.append(str(e))
            continue
        rows.append((n, msgs, source, truth if isinstance(truth, str) else json.dumps(truth), extra))
    return RowScan(path, rows, problems)


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


def with_system_prompt(messages: list[dict[str, str]], system_prompt: str) -> list[dict[str, str]]:
    """The messages with `system_prompt` as their system message: put before a system message the
    row has (one paragraph apart; templates expect one system message, first), or as a new first one."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{system_prompt}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": system_prompt}, *messages]


class PromptDataset:
    """All prompts of `files`, tokenized with the chat template, in file order.

    `tokenizer` is a HuggingFace tokenizer with a chat template (or the path of one). Rows that do not
    fit the schema (or lines that are not UTF-8 JSON) are skipped and logged with their row or line
    numbers while they are at most `max_skipped_row_share` of a file; above that the file is refused.
    For multi-turn rollouts with tools: `tools` (function schemas) go to the chat template's `tools=`,
    and `system_prompt` opens each prompt's system message (see `with_system_prompt`).
    """

    def __init__(self, files: list[str], tokenizer: Any, prompt_key: str = "prompt", max_prompt_length: int = 512,
                 max_skipped_row_share: float = 0.0, tools: list[dict[str, Any]] | None = None,
                 system_prompt: str | None = None):
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
        self.num_skipped = 0
        for f in self.files:
            scan = scan_rows(f, prompt_key)
            self.num_skipped += scan.accept(max_skipped_row_share, f)
            for _, msgs, source, truth, extra in scan.rows:
                messages.append(msgs)
                meta.append((source, truth, extra))
        if not messages:
            raise ValueError(f"data: {', '.join(self.files)} hold no rows.")
        if system_prompt:
            messages = [with_system_prompt(m, system_prompt) for m in messages]
        extra = {"tools": tools} if tools else {}
        texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **extra)
                 for m in messages]
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
