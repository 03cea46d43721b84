"""The multi-turn rollout loop: every sample a conversation with tools, all samples batched per turn.

Runs on the controller, which decides, calls the tools and appends token ids; each turn is one
batched generation on the rollout engines (hpcrl.workers.actor_rollout.generate_each: the still
active conversations cut over the vLLM replicas as `generate` cuts prompts)::

    loop = MultiTurnRollout.from_config(cfg.rollout.multi_turn, tokenizer)
    out = loop.generate(partial(generate_each, actor), prompt_ids, sampling)
    out.batch            # generate()'s wire format; response_mask = 1 on the model's tokens only
    out.metrics          # multi_turn/*: turns, tool calls, errors, timeouts, why samples ended
    out.truncated        # per sample: cut by a token limit (the reward's `truncated`)

One turn, for every active conversation (row i * n + j: sample j of prompt i, as in `generate`)::

    running token ids --(vLLM, seed turn_seed(seed, row, turn), limit min(max_new_tokens, budget left))-->
    the turn's token ids + log-probs, appended as they are         (response_mask 1, rollout_logprob)
      cut by the token limit          -> ends: "budget" when the budget is spent, else "turn_length"
      no tool call in the turn        -> ends: "answer"
      calls, max_turns turns done     -> ends: "max_turns" (the calls are not run)
      calls                           -> the tools run (every conversation's calls of the turn at once);
                                         their answers as the chat template renders tool messages,
                                         tokenised on their own and appended    (response_mask 0)
                                         (no room left for a model token after them -> ends: "budget")

Token-exact: the model's tokens are never decoded and re-tokenised into the sequence; what the
trainer gets is byte for byte what vLLM was fed and returned. Only the tool turn's text (which the
model did not write) is tokenised, alone (ToolTurnRenderer): the template's own text with its special
tokens, each tool's answer as plain text, so an answer holding "<|im_start|>" cannot forge a turn.
Whatever the model's turn holds, parsing it never raises: a format that fails gives the model an
error answer (kind "parse"), and the rollout goes on. The trainer does not know turns
existed: tool tokens are context (attended to) but outside the loss mask, so they carry no loss, no
advantage, no KL and no rollout-vs-actor gap (hpcrl.algos, hpcrl.workers.batching).

Seeds: turn 0 of row r samples from seed + r, the stream `generate` gives that sample (a loop with
max_turns=1 reproduces `generate`); later turns from a hash of (seed, row, turn). Neither depends on
the replica split nor on which other conversations are still active, so a run is reproducible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hpcrl.agents.builtin_tools import load_tool
from hpcrl.agents.formats import ToolCallFormat, load_format
from hpcrl.agents.tools import ToolCall, ToolCallError, ToolResult, ToolSet, tool_messages
from hpcrl.controller.batch import Batch
from hpcrl.engines.vllm.engine import SEED_SPACE, Completion, SamplingSettings

log = logging.getLogger("hpcrl.agents")

END_REASONS = ("answer", "max_turns", "budget", "turn_length")
# ToolResult.error_kind of a failed call (hpcrl.agents.tools), and calls past max_tool_calls_per_turn
ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "exception", "timeout", "queue_timeout", "unavailable",
               "too_many_calls")

# (requests, sampling, seeds, max new tokens) -> one completion per request, in order
TurnGenerator = Callable[[Sequence[Sequence[int]], SamplingSettings, Sequence[int | None], Sequence[int]],
                         list[Completion]]


def turn_seed(seed: int | None, row: int, turn: int) -> int | None:
    """Sampling seed of turn `turn` (0-based) of the conversation in row `row` (= i * n + j). Turn 0
    is seed + row, what `generate` gives sample j of prompt i (engine.sample_seed); later turns a hash
    of (seed, row, turn), so no two turns of one call share a stream."""
    if seed is None:
        return None
    if turn == 0:
        return (seed + row) % SEED_SPACE
    key = f"{seed}/{row}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % SEED_SPACE


def system_prompt_with_tools(system_prompt: str | None, schemas: Sequence[Mapping[str, Any]]) -> str | None:
    """rollout.multi_turn.system_prompt with "{tools}" replaced by the tools' JSON schemas, one a line
    (for chat templates that do not render `tools=` themselves)."""
    if not system_prompt:
        return None
    return system_prompt.replace("{tools}", "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


class ToolTurnRenderer:
    """The text that follows a model turn with tool calls, as the model's chat template renders it:
    the close of the model's turn that the model did not write itself (e.g. Qwen's "\\n" after the
    <|im_end|> it generated), the tool messages, and the opening of the next assistant turn.

    Found by rendering a probe conversation (user, assistant) with and without the tool messages
    (+ generation prompt): the tool turn is the difference. Only this text is tokenised, on its
    own; the model's tokens before it stay as generated."""

    _MARK = "HPCRL_MODEL_TURN_0b7e"
    _PROBE = ({"role": "user", "content": "?"},)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        closed = self._render([*self._PROBE, {"role": "assistant", "content": self._MARK}], False)
        at = closed.rfind(self._MARK)
        if at < 0:
            raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} does not render an "
                             "assistant message's content; multi-turn rollout cannot place tool answers after it")
        self._closed = closed
        # what the template writes after an assistant message's content (Qwen, SmolLM2: "<|im_end|>\n")
        self.turn_end = closed[at + len(self._MARK):]
        ids = tokenizer(self.turn_end, add_special_tokens=False)["input_ids"]
        # (token ids, the text left to write) for each whole-token prefix of turn_end the model may
        # have generated itself, longest first: (<|im_end|>, "\n") for Qwen's template
        self._turn_end_prefixes: list[tuple[list[int], str]] = []
        for k in range(len(ids), 0, -1):
            piece = tokenizer.decode(ids[:k], skip_special_tokens=False)
            if self.turn_end.startswith(piece):
                self._turn_end_prefixes.append((ids[:k], self.turn_end[len(piece):]))
        self._placeholder = f"HPCRL_TOOL_ANSWER_{secrets.token_hex(4)}"
        self.token_ids([ToolResult("probe", "probe answer")], [])  # fails here, not mid-rollout

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def rest_of_turn_end(self, model_ids: Sequence[int]) -> str:
        """The part of the template's end-of-turn text that the model's turn does not end with
        (compared in whole tokens: a turn that ended on "<" has not begun "<|im_end|>")."""
        for ids, rest in self._turn_end_prefixes:
            if len(model_ids) >= len(ids) and list(model_ids[-len(ids):]) == ids:
                return rest
        return self.turn_end

    def render(self, results: Sequence[ToolResult], model_ids: Sequence[int]) -> str:
        """The text appended after a model turn (its token ids) whose calls gave `results`."""
        full = self._render([*self._PROBE, {"role": "assistant", "content": self._MARK}, *tool_messages(results)],
                            True)
        if not full.startswith(self._closed):
            raise ValueError("the chat template renders the conversation before the tool messages differently once "
                             "they are added; multi-turn rollout needs the tool turn to be appended text")
        return self.rest_of_turn_end(model_ids) + full[len(self._closed):]

    def token_ids(self, results: Sequence[ToolResult], model_ids: Sequence[int]) -> list[int]:
        """The tool turn's token ids: the template's text with its special tokens; each answer, which
        a tool (or a program the model wrote) chose, as plain text where "<|im_start|>" is characters."""
        marks = [f"{self._placeholder}_{i}_" for i in range(len(results))]
        text = self.render([dataclasses.replace(r, content=m) for r, m in zip(results, marks)], model_ids)
        ids: list[int] = []
        pos = 0
        for mark, r in zip(marks, results):
            at = text.find(mark, pos)
            if at < 0:
                raise ValueError("the chat template changes a tool message's content; multi-turn rollout needs it "
                                 "rendered as it is")
            ids += self._ids(text[pos:at], special=True)
            ids += self._ids(r.content, special=False)
            pos = at + len(mark)
        return ids + self._ids(text[pos:], special=True)

    def _ids(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"])


@dataclass
class Segment:
    """A run of tokens of one conversation: a model turn (with vLLM's log-probs) or a tool turn."""

    token_ids: list[int]
    from_model: bool
    logprobs: list[float] | None = None


@dataclass
class Conversation:
    """One sample: its prompt, what followed it, and how it went."""

    prompt_index: int
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_results: list[ToolResult] = field(default_factory=list)
    end: str | None = None  # one of END_REASONS once it ended

    @property
    def used(self) -> int:
        """Tokens after the prompt, model and tool."""
        return sum(len(s.token_ids) for s in self.segments)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + [t for s in self.segments for t in s.token_ids]

    @property
    def truncated(self) -> bool:
        return self.end in ("budget", "turn_length")


@dataclass
class MultiTurnResult:
    batch: Batch
    conversations: list[Conversation]
    metrics: dict[str, float]

    @property
    def truncated(self) -> list[bool]:
        return [c.truncated for c in self.conversations]

    def reward_extra(self, tokenizer: Any) -> list[dict[str, Any]]:
        """Per sample, for the reward's extra_info["multi_turn"]: the whole exchange after the prompt
        as text (tool answers included; the reward's response is the model's own text only), its
        turns, calls and errors, and why it ended."""
        return [{"transcript": tokenizer.decode(c.token_ids()[len(c.prompt_ids):], skip_special_tokens=False),
                 "turns": c.turns, "tool_calls": c.tool_calls,
                 "tool_errors": sum(r.error for r in c.tool_results), "end": c.end}
                for c in self.conversations]


class MultiTurnRollout:
    """The turn loop (see the module docstring). Tools run on this process's event loop; a sync
    tool's call in a thread of its own (hpcrl.agents.tools.Tool.acall), so that a timed-out call,
    which cannot be stopped, is left running without holding the rollout or later calls up."""

    def __init__(self, tokenizer: Any, tools: ToolSet, call_format: ToolCallFormat, max_turns: int,
                 max_total_tokens: int, max_tool_calls_per_turn: int = 4):
        if max_turns < 1 or max_total_tokens < 1 or max_tool_calls_per_turn < 1:
            raise ValueError("max_turns, max_total_tokens and max_tool_calls_per_turn must be >= 1")
        self.tokenizer = tokenizer
        self.tools = tools
        self.format = call_format
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.renderer = ToolTurnRenderer(tokenizer)
        self._loop = asyncio.new_event_loop()

    @classmethod
    def from_config(cls, mt: Mapping[str, Any], tokenizer: Any) -> MultiTurnRollout:
        """From rollout.multi_turn (a DictConfig or its plain dict)."""
        tools = []
        for i, spec in enumerate(mt["tools"]):
            try:
                tools.append(load_tool(spec if isinstance(spec, str) else dict(spec)))
            except ValueError as e:  # a tool's kwargs are only checked by building it
                raise ValueError(f"rollout.multi_turn.tools[{i}]: {e}") from e
        fmt = mt["format"]
        try:
            call_format = load_format(fmt if isinstance(fmt, str) else dict(fmt))
        except ValueError as e:
            raise ValueError(f"rollout.multi_turn.format: {e}") from e
        return cls(tokenizer, ToolSet(tools, default_timeout_s=float(mt["tool_timeout_s"]),
                                      max_result_chars=int(mt["max_tool_result_chars"])),
                   call_format, int(mt["max_turns"]), int(mt["max_total_tokens"]), int(mt["max_tool_calls_per_turn"]))

    def close(self) -> None:
        self._loop.close()

    # the loop ----------------------------------------------------------------------------------
    def generate(self, generate_turn: TurnGenerator, prompts: Sequence[Sequence[int]],
                 sampling: SamplingSettings) -> MultiTurnResult:
        """`sampling.n` conversations per prompt; `sampling.max_new_tokens` bounds each model turn."""
        n = sampling.n
        convs = [Conversation(i, list(map(int, p))) for i, p in enumerate(prompts) for _ in range(n)]
        turn_sampling = replace(sampling, n=1, stop=[*sampling.stop, *self.format.stop])
        active = list(range(len(convs)))
        tool_s = 0.0
        turn = 0
        while active:
            limits = [min(sampling.max_new_tokens, self.max_total_tokens - convs[r].used) for r in active]
            outs = generate_turn([convs[r].token_ids() for r in active], turn_sampling,
                                 [turn_seed(sampling.seed, r, turn) for r in active], limits)
            if len(outs) != len(active):
                raise RuntimeError(f"multi-turn rollout: {len(active)} requests, {len(outs)} completions")
            calling: list[tuple[int, list[ToolCall | ToolCallError]]] = []
            for r, out in zip(active, outs):
                c = convs[r]
                c.turns += 1
                c.segments.append(Segment(list(out.token_ids), True, list(out.logprobs)))
                if out.finish_reason != "stop":  # cut by its token limit: the turn is unfinished
                    c.end = "budget" if c.used >= self.max_total_tokens else "turn_length"
                    continue
                calls = self._parse(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
                if not calls:
                    c.end = "answer"
                elif c.turns >= self.max_turns:
                    c.end = "max_turns"
                else:
                    calling.append((r, calls))
            if calling:
                t = time.perf_counter()
                results = self._run_tools([calls for _, calls in calling])
                tool_s += time.perf_counter() - t
                for (r, calls), res in zip(calling, results):
                    c = convs[r]
                    c.tool_calls += len(calls)
                    c.tool_results += res
                    ids = self.renderer.token_ids(res, c.segments[-1].token_ids)
                    if c.used + len(ids) >= self.max_total_tokens:  # no room left for the model's next turn
                        c.end = "budget"
                        continue
                    c.segments.append(Segment(ids, False))
            active = [r for r in active if convs[r].end is None]
            turn += 1
        metrics = self._metrics(convs, tool_s)
        self._report(convs, metrics)
        return MultiTurnResult(self._batch(convs), convs, metrics)

    def _parse(self, text: str) -> list[ToolCall | ToolCallError]:
        """The turn's calls; a format that raises on what the model wrote gives one parse error."""
        try:
            return list(self.format.parse(text))
        except Exception as e:
            return [ToolCallError(f"your tool calls could not be read ({type(e).__name__}); write each call as "
                                  "the tool-call format shows.", text[-200:])]

    def _run_tools(self, per_conversation: list[list[ToolCall | ToolCallError]]) -> list[list[ToolResult]]:
        """Every conversation's calls of this turn, concurrently; results per conversation in call
        order. Calls beyond max_tool_calls_per_turn are not run: each gets an error answer."""
        k = self.max_tool_calls_per_turn

        async def one(calls: list[ToolCall | ToolCallError]) -> list[ToolResult]:
            results = await self.tools.execute_all(calls[:k])
            return results + [ToolResult(c.name if isinstance(c, ToolCall) else "", f"Error: at most {k} tool calls "
                                         "are run per turn; this one was not.", True, "too_many_calls")
                              for c in calls[k:]]

        async def every() -> list[list[ToolResult]]:
            return list(await asyncio.gather(*(one(calls) for calls in per_conversation)))

        return self._loop.run_until_complete(every())

    # output ------------------------------------------------------------------------------------
    @staticmethod
    def _batch(convs: list[Conversation]) -> Batch:
        """generate()'s wire format: right-padded prompt + conversation rows; response_mask and
        rollout_logprob on the model's tokens only."""
        width = max(len(c.prompt_ids) + c.used for c in convs)
        rows = len(convs)
        ids = torch.zeros(rows, width, dtype=torch.long)
        attn = torch.zeros(rows, width, dtype=torch.long)
        resp = torch.zeros(rows, width)
        lp = torch.zeros(rows, width)
        for r, c in enumerate(convs):
            pos = len(c.prompt_ids)
            ids[r, :pos] = torch.tensor(c.prompt_ids)
            for s in c.segments:
                end = pos + len(s.token_ids)
                ids[r, pos:end] = torch.tensor(s.token_ids, dtype=torch.long)
                if s.from_model:
                    resp[r, pos:end] = 1
                    lp[r, pos:end] = torch.tensor(s.logprobs)
                pos = end
            attn[r, :pos] = 1
        return Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp, "rollout_logprob": lp,
                      "prompt_index": torch.tensor([c.prompt_index for c in convs])})

    @staticmethod
    def _metrics(convs: list[Conversation], tool_s: float) -> dict[str, float]:
        results = [r for c in convs for r in c.tool_results]
        kinds = Counter(r.error_kind for r in results if r.error)
        turns = [c.turns for c in convs]
        model = sum(len(s.token_ids) for c in convs for s in c.segments if s.from_model)
        tool = sum(len(s.token_ids) for c in convs for s in c.segments if not s.from_model)
        ends = Counter(c.end for c in convs)
        out = {
            "multi_turn/turns_mean": sum(turns) / len(turns), "multi_turn/turns_max": float(max(turns)),
            "multi_turn/tool_calls": float(len(results)),
            "multi_turn/tool_calls_per_sample": len(results) / len(convs),
            "multi_turn/tool_errors": float(sum(kinds.values())),
            "multi_turn/tool_timeouts": float(kinds.get("timeout", 0)),
            "multi_turn/tool_token_share": tool / max(model + tool, 1),
            "multi_turn/tokens_after_prompt_max": float(max(c.used for c in convs)),
            "multi_turn/tool_s": tool_s,
        }
        out.update({f"multi_turn/ended_{reason}": ends.get(reason, 0) / len(convs) for reason in END_REASONS})
        out.update({f"multi_turn/tool_errors_{kind}": float(kinds.get(kind, 0)) for kind in ERROR_KINDS})
        return out

    @staticmethod
    def _report(convs: list[Conversation], m: dict[str, float]) -> None:
        ends = ", ".join(f"{r} {round(m[f'multi_turn/ended_{r}'] * len(convs))}" for r in END_REASONS)
        log.info("multi-turn rollout: %d samples, turns mean %.2f max %d, %d tool calls, %d errors; ended: %s",
                 len(convs), m["multi_turn/turns_mean"], m["multi_turn/turns_max"], m["multi_turn/tool_calls"],
                 m["multi_turn/tool_errors"], ends)
        failed = [r for c in convs for r in c.tool_results if r.error]
        if failed:
            kinds = Counter(r.error_kind for r in failed)
            first = failed[0]
            log.warning("multi-turn rollout: %d of %d tool calls failed (%s), the model got the error as the "
                        "answer; first: %s: %s", len(failed), int(m["multi_turn/tool_calls"]),
                        ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())), first.name or "(parse)",
                        first.content[:200])
