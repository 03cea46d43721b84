"""Multi-turn agents. For now the tool interface (`tools.py`): the Tool base class, loading tools from
config, parsing the model's <tool_call> blocks, formatting results as the next turn, and the built-in
`calculator` and `python` (the latter runs code in hpcrl.sandbox). The turn loop over the rollout
engine comes next; see docs/agents.md.
"""

from hpcrl.agents.tools import (
    CalculatorTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolCallError,
    ToolError,
    ToolOutput,
    ToolResult,
    ToolSet,
    format_tool_call,
    format_tool_responses,
    load_tool,
    load_tools,
    parse_tool_calls,
    tool_messages,
)

__all__ = ["CalculatorTool", "PythonTool", "Tool", "ToolCall", "ToolCallError", "ToolError", "ToolOutput",
           "ToolResult", "ToolSet", "format_tool_call", "format_tool_responses", "load_tool", "load_tools",
           "parse_tool_calls", "tool_messages"]
