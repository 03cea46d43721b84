"""Offline preference pairs for DPO, in TRL's preference schema: .parquet, .jsonl or .json.

A row holds `prompt`, `chosen` and `rejected` (the keys are `data.prompt_key`, `data.chosen_key`,
`data.rejected_key`), in one of two forms:

- plain text: three strings. The prompt becomes one user turn;
- conversational: `prompt` is chat messages (a list of {role, content}), `chosen` and `rejected`
  are the assistant turn(s) that follow it (a list of messages that starts and ends with an
  assistant turn), or strings (one assistant turn).

Tokenising is token-exact and shared: the prompt is the chat template of its messages with the
generation prompt (as hpcrl.data.dataset tokenises RL prompts), tokenised once; each response is
tokenised on its own and appended, so the chosen and the rejected sequence begin with the very same
prompt ids (the engine then packs the prompt once for both). A response is its text's tokens + EOS
(what a rollout generates); a conversational response is the chat template's rendering of its
turns after the generation prompt, cut after its last EOS when only whitespace follows it (the
template's newline after the turn end), and given an EOS when it has none.

Rows that do not fit (missing or mistyped fields, empty text, chosen equal to rejected, lines that
are not UTF-8 JSON) are skipped and named while they are at most `max_skipped_row_share` of a
file; above that the file is refused. Pairs whose prompt is longer than `max_prompt_length` tokens
or whose chosen or rejected response is longer than `max_response_length` are dropped, counted in
`num_filtered` and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.data.dataset import RowScan, _messages, _records

log = logging.getLogger("hpcrl.data")

# A response as a row gives it: plain text, or the assistant turn(s) as chat messages.
Response = str | list[dict[str, str]]


@dataclass
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]  # the response's tokens, EOS included (the prompt's are not repeated)
    rejected_ids: list[int]
    index: int  # position in this dataset (what samplers hand out), after filtering


@dataclass
class PreferenceScan(RowScan):
    """A preference file checked row by row (RowScan's share rule decides whether it is refused)."""

    # (row number, prompt messages, chosen, rejected) of each usable row
    rows: list[tuple[int, list[dict[str, str]], Response, Response]]  # type: ignore[assignment]
    # the keys that appear in at least one row: a column missing from all of them is named as such
    keys_seen: set[str] = field(default_factory=set)

    def missing_keys(self, *keys: str) -> list[str]:
        """The keys no row has (only meaningful when the file has rows)."""
        return [k for k in keys if k not in self.keys_seen] if self.total else []


def _response(value: Any, path: Path, n: int, key: str) -> Response:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{path}: row {n}: {key!r} is empty.")
        return value
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in value)):
        msgs = [{"role": m["role"], "content": m["content"]} for m in value]
        if msgs[0]["role"] != "assistant" or msgs[-1]["role"] != "assistant":
            raise ValueError(f"{path}: row {n}: {key!r} must start and end with an assistant turn (the response "
                             f"that follows the prompt); got roles {[m['role'] for m in msgs]}.")
        return msgs
    raise ValueError(f"{path}: row {n}: {key!r} must be text or chat messages (a non-empty list of "
                     f"{{'role': str, 'content': str}}); got {str(value)[:120]!r}.")


def scan_preference_rows(path: str | Path, prompt_key: str = "prompt", chosen_key: str = "chosen",
                         rejected_key: str = "rejected") -> PreferenceScan:
    """Read a preference file and check each row against the schema (no tokenizing)."""
    path = Path(path)
    records, problems = _records(path)
    rows: list[tuple[int, list[dict[str, str]], Response, Response]] = []
    seen: set[str] = set()
    for n, row in records:
        try:
            if not isinstance(row, dict):
                raise ValueError(f"{path}: row {n} is a {type(row).__name__}, expected a JSON object.")
            seen.update(k for k, v in row.items() if v is not None)
            for key in (prompt_key, chosen_key, rejected_key):
                if row.get(key) is None:
                    raise ValueError(f"{path}: row {n} has no {key!r} (preference schema: {{prompt, chosen, "
                                     "rejected}).")
            if isinstance(row[prompt_key], str) and not row[prompt_key].strip():
                raise ValueError(f"{path}: row {n}: {prompt_key!r} is empty.")
            prompt = _messages(row[prompt_key], path, n, prompt_key)
            chosen = _response(row[chosen_key], path, n, chosen_key)
            rejected = _response(row[rejected_key], path, n, rejected_key)
            if chosen == rejected:  # no preference to learn: its gradient is 0 and its accuracy undefined
                raise ValueError(f"{path}: row {n}: {chosen_key!r} and {rejected_key!r} are the same.")
        except ValueError as e:
            problems.append(str(e))
            continue
        rows.append((n, prompt, chosen, rejected))
    return PreferenceScan(path, rows, problems, seen)  # type: ignore[arg-type]


def _eos_terminated(ids: list[int], eos: int, whitespace: set[int]) -> list[int]:
    """A rendered response cut after its last EOS when only whitespace tokens follow it, else with
    an EOS appended."""
    if eos in ids:
        last = len(ids) - 1 - ids[::-1].index(eos)
        if all(t in whitespace for t in ids[last + 1:]):
            return ids[:last + 1]
    return [*ids, eos]


class PreferenceDataset:
    """All preference pairs of `files`, tokenised (see the module docstring), in file order.

    `tokenizer` is a HuggingFace tokenizer with a chat template and an EOS token (or the path of one).
    """

    def __init__(self, files: list[str], tokenizer: Any, prompt_key: str = "prompt", chosen_key: str = "chosen",
                 rejected_key: str = "rejected", max_prompt_length: int = 512, max_response_length: int = 512,
                 max_skipped_row_share: float = 0.0):
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; prompts "
                             "are tokenised with it. Use an instruct/chat tokenizer (model.tokenizer_path).")
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token; every "
                             "response ends with one.")
        if not files:
            raise ValueError("data: no files given (data.train_files / data.val_files).")
        self.files = [str(f) for f in files]
        eos = int(tokenizer.eos_token_id)
        prompts: list[list[dict[str, str]]] = []
        responses: list[tuple[Response, Response]] = []
        self.num_skipped = 0
        for f in self.files:
            scan = scan_preference_rows(f, prompt_key, chosen_key, rejected_key)
            missing = scan.missing_keys(prompt_key, chosen_key, rejected_key)
            if missing:
                raise ValueError(f"{f}: no row has {', '.join(map(repr, missing))} (data.prompt_key / chosen_key / "
                                 "rejected_key): DPO reads preference pairs {prompt, chosen, rejected}.")
            self.num_skipped += scan.accept(max_skipped_row_share, f)
            for _, prompt, chosen, rejected in scan.rows:
                prompts.append(prompt)
                responses.append((chosen, rejected))
        if not prompts:
            raise ValueError(f"data: {', '.join(self.files)} hold no rows.")
        prompt_texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
        prompt_ids = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]
        # every response's text and whether the chat template rendered it (then it carries its turn end)
        texts: list[str] = []
        rendered: list[bool] = []
        for msgs, text, pair in zip(prompts, prompt_texts, responses, strict=True):
            for resp in pair:
                if isinstance(resp, str):
                    texts.append(resp)
                    rendered.append(False)
                    continue
                full = tokenizer.apply_chat_template(msgs + resp, tokenize=False)
                if not full.startswith(text):
                    raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} does not "
                                     "render prompt + response as the prompt (with its generation prompt) followed "
                                     "by the response, so the two cannot share the prompt's tokens; give chosen / "
                                     "rejected as plain text.")
                texts.append(full[len(text):])
                rendered.append(True)
        response_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        whitespace = {i for i in set(t for ids in response_ids for t in ids) if not tokenizer.decode([i]).strip()}
        whitespace.discard(eos)
        finished = [_eos_terminated(list(ids), eos, whitespace) if r else [*ids, eos]
                    for ids, r in zip(response_ids, rendered, strict=True)]
        self._pairs: list[tuple[list[int], list[int], list[int]]] = []
        too_long_prompt = too_long_response = 0
        for i, p in enumerate(prompt_ids):
            chosen, rejected = finished[2 * i], finished[2 * i + 1]
            if len(p) > max_prompt_length:
                too_long_prompt += 1
            elif max(len(chosen), len(rejected)) > max_response_length:
                too_long_response += 1
            elif chosen == rejected:  # different text, the same tokens (e.g. only trailing whitespace apart)
                self.num_skipped += 1
            else:
                self._pairs.append((list(p), chosen, rejected))
        self.num_filtered = too_long_prompt + too_long_response
        if not self._pairs:
            raise ValueError(f"data: none of the {len(prompt_ids)} pairs of {', '.join(self.files)} fits: "
                             f"{too_long_prompt} prompt(s) longer than data.max_prompt_length={max_prompt_length}, "
                             f"{too_long_response} with a response longer than data.max_response_length="
                             f"{max_response_length} tokens.")
        level = logging.WARNING if self.num_filtered else logging.INFO
        log.log(level, "data: %d preference pairs from %s; %d filtered out (%d prompts longer than "
                "max_prompt_length=%d, %d responses longer than max_response_length=%d tokens)", len(self._pairs),
                ", ".join(self.files), self.num_filtered, too_long_prompt, max_prompt_length, too_long_response,
                max_response_length)

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, i: int) -> PreferencePair:
        if not 0 <= i < len(self._pairs):
            raise IndexError(f"pair index {i} out of range for a dataset of {len(self._pairs)} pairs")
        p, c, r = self._pairs[i]
        return PreferencePair(prompt_ids=list(p), chosen_ids=list(c), rejected_ids=list(r), index=i)
