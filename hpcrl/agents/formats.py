"""Tool-call formats: how a model writes its calls, for the multi-turn rollout (hpcrl.agents.rollout).

A format parses one model turn's text into calls and may name stop strings that end a turn at a
call. Only the calls are the format's business: the tool answers are rendered by the model's own
chat template (rollout.ToolTurnRenderer), whatever the format.

    fmt = load_format("hermes")                       # rollout.multi_turn.format
    fmt = load_format({"class": "my_pkg.fmt:Mine", "kwargs": {...}})
    calls = fmt.parse(turn_text)                      # [] = the turn is an answer

`hermes` is the Qwen2.5 / Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, several per turn; a malformed block is a ToolCallError, which the model gets an error
answer for (hpcrl.agents.tools.parse_tool_calls).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcrl.agents.tools import ToolCall, ToolCallError, build_from_spec, parse_tool_calls


class ToolCallFormat:
    """How a model writes tool calls. `parse` gives the calls of one model turn in order ([] when the
    turn holds none: it is the answer); `stop` are stop strings added to rollout.stop during
    multi-turn rollouts, for formats whose calls end the model's turn."""

    name: str = ""
    stop: tuple[str, ...] = ()

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    """`<tool_call>{json}</tool_call>` blocks (Qwen2.5, Hermes). Models trained on it end their turn
    after the calls with their end-of-turn token; stop_at_call=True also ends the turn at the first
    `</tool_call>`, for models that go on writing after a call."""

    name = "hermes"

    def __init__(self, stop_at_call: bool = False):
        self.stop = ("</tool_call>",) if stop_at_call else ()

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        return parse_tool_calls(text)


BUILTIN_FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat}


def load_format(spec: str | Mapping[str, Any]) -> ToolCallFormat:
    """A format from config: a built-in name ("hermes"), or {"class": "package.module:Class" or a
    built-in name, "kwargs": {...}}; Class(**kwargs) must be a ToolCallFormat. ValueError naming
    what is wrong."""
    return build_from_spec(spec, BUILTIN_FORMATS, ToolCallFormat, "tool-call format")
