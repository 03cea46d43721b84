"""Multi-turn agents (docs/agents.md).

- `tools.py`: the tool interface (Tool, ToolSet: execution that never raises), loading tools from
  config, parsing <tool_call> blocks, and the built-in `calculator` and `python` (in hpcrl.sandbox).
- `formats.py`: tool-call formats (how calls are written: `hermes`, or a custom ToolCallFormat).
- `rollout.py`: the turn loop over the rollout engines (MultiTurnRollout; imported on its own, it
  needs torch): conversations batched per turn, tool answers appended as token ids, the trainer's
  batch with the tool tokens outside the loss mask.
- `toy.py`: a marker format and a counting tool that the tiny random model of CI can use.
"""

from hpcrl.agents.builtin_tools import CalculatorTool, PythonTool, load_tool, load_tools
from hpcrl.agents.formats import HermesFormat, ToolCallFormat, load_format
from hpcrl.agents.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    ToolError,
    ToolOutput,
    ToolResult,
    ToolSet,
    format_tool_call,
    format_tool_responses,
    parse_tool_calls,
    tool_messages,
)

__all__ = ["CalculatorTool", "HermesFormat", "PythonTool", "Tool", "ToolCall", "ToolCallError", "ToolCallFormat",
           "ToolError", "ToolOutput", "ToolResult", "ToolSet", "format_tool_call", "format_tool_responses",
           "load_format", "load_tool", "load_tools", "parse_tool_calls", "tool_messages"]
