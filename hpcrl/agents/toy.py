"""A tool-call format and a tool that a tiny random model can use: CI's multi-turn runs.

The tiny random Qwen2 of the tests never writes a well-formed `<tool_call>{json}</tool_call>`, so
with the Hermes format its rollouts would never call a tool and the multi-turn machinery would go
untested. `MarkerFormat` reads a call wherever the model writes a marker string that it writes
often (one character), and the marker is a stop string, so the turn ends at the call as a real call
ends a turn. Nothing else is scripted: vLLM samples every token, the loop (hpcrl.agents.rollout)
parses the turn, runs the tool through the ToolSet (timeouts, errors) and appends the chat
template's tool message as it would for any format. `TextStatsTool` answers with a count of the
text before the marker and fails, or hangs past its timeout, for some lengths of it, so that a run
has failing calls to report and count.

    rollout.multi_turn.format: {class: hpcrl.agents.toy:MarkerFormat, kwargs: {marker: "e"}}
    rollout.multi_turn.tools: [{class: hpcrl.agents.toy:TextStatsTool, kwargs: {fail_every: 3}}]
"""

from __future__ import annotations

import time
from typing import Any

from hpcrl.agents.formats import ToolCallFormat
from hpcrl.agents.tools import Tool, ToolCall, ToolCallError, ToolError


class MarkerFormat(ToolCallFormat):
    """A turn that contains `marker` is one call of `tool` with {"text": the turn's text before the
    marker}; the marker is a stop string, so a turn with a call ends at it. The turn's text includes
    special tokens, so a turn the model ends with its own <|im_end|> (an "e" that vLLM's stop check,
    which reads the text without special tokens, does not see) is a call too: the loop then appends
    only the rest of the template's turn end (tests/programs/rollout_checks.py checks both cases)."""

    name = "marker"

    def __init__(self, marker: str = "e", tool: str = "text_stats"):
        if not marker:
            raise ValueError("MarkerFormat: the marker must not be empty")
        self.marker = marker
        self.tool = tool
        self.stop = (marker,)

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        at = text.find(self.marker)
        if at < 0:
            return []
        return [ToolCall(self.tool, {"text": text[:at]}, text[:at + len(self.marker)])]


class TextStatsTool(Tool):
    """Counts the characters and digits of a text. Deterministic failures for tests: a text whose
    length is a multiple of `fail_every` raises (ToolError), one whose length leaves 1 when divided
    by `hang_every` sleeps `hang_s` first (beyond `timeout_s`: a timeout). 0 turns either off."""

    name = "text_stats"
    description = "Count the characters and the digits of a text."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "the text to count"}},
        "required": ["text"],
        "additionalProperties": False,
    }

    def __init__(self, fail_every: int = 0, hang_every: int = 0, hang_s: float = 1.0, timeout_s: float | None = None):
        self.fail_every = fail_every
        self.hang_every = hang_every
        self.hang_s = hang_s
        self.timeout_s = timeout_s

    def call(self, arguments: dict[str, Any]) -> str:
        text = arguments["text"]
        n = len(text)
        if self.hang_every and n % self.hang_every == 1:
            time.sleep(self.hang_s)
        if self.fail_every and n % self.fail_every == 0:
            raise ToolError(f"cannot count a text of {n} characters (it fails for multiples of {self.fail_every})")
        return f"{n} characters, {sum(c.isdigit() for c in text)} digits"
