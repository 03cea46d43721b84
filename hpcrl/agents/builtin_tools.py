"""The built-in tools (`calculator`, `python`) and the loader of a config's tool list
(`rollout.multi_turn.tools`: built-in names or {"class": "package.module:Class", "kwargs": {...}}).
The interface they implement, the call parser and the executor are hpcrl.agents.tools.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any

from hpcrl.agents.tools import Tool, ToolError, ToolOutput, _trim, build_from_spec


class CalculatorTool(Tool):
    """Arithmetic on numbers: + - * / // % **, unary minus, parentheses; ints and floats. Evaluated on
    the syntax tree (no eval): names, calls, attributes and everything else are refused. Sizes are
    bounded: integers up to max_int_digits digits, exponents up to max_exponent, expressions up to
    max_length characters."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression with + - * / // % ** and parentheses, e.g. "
                   "\"(3 + 4) * 2 ** 10 / 7\". Numbers only: no variables or functions.")
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    _BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    _UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
    _SYMBOLS = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
                ast.RShift: ">>", ast.MatMult: "@"}

    def __init__(self, max_int_digits: int = 1000, max_exponent: int = 10000, max_length: int = 1000):
        self.max_int_bits = int(max_int_digits * math.log2(10)) + 1
        self.max_exponent = max_exponent
        self.max_length = max_length

    def call(self, arguments: dict[str, Any]) -> str:
        return self.evaluate(arguments["expression"])

    def evaluate(self, expression: str) -> str:
        """The value as text; ToolError with a message for the model otherwise."""
        if len(expression) > self.max_length:
            raise ToolError(f"the expression is longer than {self.max_length} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as e:
            raise ToolError(f"not an arithmetic expression: {e.msg}") from None
        except (ValueError, MemoryError, RecursionError) as e:
            raise ToolError(f"not an arithmetic expression: {e}") from None
        try:
            value = self._eval(tree.body)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
        except RecursionError:
            raise ToolError("the expression is nested too deeply") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        return repr(value) if isinstance(value, float) else str(value)

    def _check_int(self, value: int | float) -> int | float:
        if isinstance(value, int) and value.bit_length() > self.max_int_bits:
            raise ToolError(f"an intermediate result has more than {self.max_int_bits * math.log10(2):.0f} digits")
        return value

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ToolError(f"only numbers are allowed, not {node.value!r}")
            return self._check_int(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UNARY:
            return self._UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp):
            if type(node.op) not in self._BINARY:
                raise ToolError(f"the operator {self._SYMBOLS.get(type(node.op), type(node.op).__name__)} is not "
                                "allowed; use + - * / // % **")
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            elif isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > self.max_int_bits + 1:
                    raise ToolError(f"the product has more than {self.max_int_bits * math.log10(2):.0f} digits")
            value = self._BINARY[type(node.op)](left, right)
            if isinstance(value, complex):
                raise ToolError("the result is a complex number")
            return self._check_int(value)
        what = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
                ast.Compare: "comparisons", ast.BoolOp: "and/or"}.get(type(node), type(node).__name__)
        raise ToolError(f"{what} are not allowed: only numbers and + - * / // % ** with parentheses")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent:
            raise ToolError(f"exponents are limited to {self.max_exponent} in size")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            # the result has about exponent * bits(base) bits: refuse before computing it
            if exponent * (abs(base).bit_length() - 1) > self.max_int_bits:
                raise ToolError(f"the power has more than {self.max_int_bits * math.log10(2):.0f} digits")


class PythonTool(Tool):
    """Runs Python code in the sandbox (hpcrl.sandbox) and returns its stdout, stderr, exit status and
    any limit it hit. kwargs: the SandboxConfig fields (wall_s, cpu_s, memory_mb, ...), plus
    max_output_chars (per stream in the answer), max_concurrency (runs at a time in this process) and
    queue_timeout_s (the longest a call waits for one of them). The program never sees what the code
    reward hides (`hpcrl.sandbox.reward.default_hidden_paths`: the working folder, $HOME, the run's
    data folders and run directory), on top of any `hidden_paths` given. Its wall limit starts when
    the program starts; a call that found no free slot in time is answered "queue_timeout"."""

    name = "python"
    description = ("Run a Python 3 program and get what it prints. Each call is a fresh process with no "
                   "network and no state kept between calls; print the values you need.")
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the complete Python program"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, max_output_chars: int = 2000, max_concurrency: int | None = None,
                 queue_timeout_s: float = 60.0, **sandbox_config: Any):
        from hpcrl.sandbox import Sandbox, SandboxConfig
        from hpcrl.sandbox.reward import default_hidden_paths

        hidden = tuple(sorted({*sandbox_config.pop("hidden_paths", ()), *default_hidden_paths()}))
        config = SandboxConfig(**{"wall_s": 10.0, "cpu_s": 5.0, **sandbox_config, "hidden_paths": hidden})
        self.sandbox = Sandbox(config, max_concurrency=max_concurrency)
        self.max_output_chars = max_output_chars
        self.queue_timeout_s = queue_timeout_s
        # the sandbox's wall limit ends the program; the tool timeout is only a backstop above it
        self.timeout_s = config.wall_s + 10.0

    def try_acquire(self) -> bool:
        return self.sandbox.try_acquire_slot()

    def release(self) -> None:
        pass  # the run gives its slot back when the program has ended (run_in_slot), not before

    async def acall(self, arguments: dict[str, Any]) -> ToolOutput:
        job = self.sandbox._executor.submit(self.sandbox.run_in_slot, arguments["code"])
        try:
            r = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancelled():  # never started: its slot is still ours
                self.sandbox._slots.release()
            raise
        if r.error:
            raise ToolError(f"the program could not be started: {r.error}")
        parts = []
        if r.stdout:
            parts.append(f"stdout:\n{_trim(r.stdout, self.max_output_chars)}")
        if r.stderr:
            parts.append(f"stderr:\n{_trim(r.stderr, self.max_output_chars)}")
        if r.limit is not None:
            parts.append(f"stopped: {_LIMIT_TEXT.get(r.limit, r.limit)}")
        elif r.exit_code:
            parts.append(f"exit status {r.exit_code}")
        if not parts:
            parts.append("(no output)")
        return ToolOutput("\n".join(parts), {"limit": r.limit, "exit_code": r.exit_code, "wall_s": r.wall_s})


_LIMIT_TEXT = {
    "timeout": "wall-clock time limit", "cpu": "CPU time limit", "memory": "memory limit",
    "processes": "process limit", "file_size": "file size limit", "output": "output size limit",
    "signal": "killed by a signal",
}


BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


def load_tool(spec: str | Mapping[str, Any]) -> Tool:
    """One tool from config: a built-in name ("calculator"), or {"class": "package.module:Class" or a
    built-in name, "kwargs": {...}}; Class(**kwargs) must be a Tool. ValueError naming what is wrong."""
    tool = build_from_spec(spec, BUILTIN_TOOLS, Tool, "tool")
    if not tool.name:
        raise ValueError(f"tool {spec!r} has no name")
    return tool


def load_tools(specs: Iterable[str | Mapping[str, Any]]) -> list[Tool]:
    """Every tool of a config list (see load_tool)."""
    return [load_tool(s) for s in specs]
