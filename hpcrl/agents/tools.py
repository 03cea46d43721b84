"""Tools a model can call during a multi-turn rollout: the interface, the loader, the call parser and
the result formatter, and two built-ins (`calculator`, `python`).

Flow in a rollout loop (the loop itself lives elsewhere):

    tools = ToolSet(load_tools(["calculator", {"class": "python", "kwargs": {"wall_s": 5}}]))
    prompt = tokenizer.apply_chat_template(messages, tools=tools.schemas(), ...)   # tools in the prompt
    items = parse_tool_calls(completion)                     # <tool_call>{...}</tool_call> blocks
    results = await tools.execute_all(items)                 # never raises; errors are results
    text = format_tool_responses(results)                    # the next (user) turn, Qwen2.5/Hermes style
    n_errors = sum(r.error for r in results)                 # for the rollout's metrics

A tool that raises, times out or gets bad arguments gives a `ToolResult` with `error=True` and a
message written for the model ("Error: ..."), so the model can correct itself and the loop goes on.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import math
import operator
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------------------------------------------
# Interface


class ToolError(Exception):
    """Raised by a tool for a failure whose message is meant for the model as it is (no traceback)."""


class Tool:
    """A callable tool. Subclasses set `name`, `description` and `parameters` (a JSON schema of the
    arguments object, OpenAI function-calling format) and implement `call` (sync; run in a thread) or
    `acall` (async). Return a string (or anything JSON-serialisable); raise ToolError for a failure
    the model should read. `timeout_s` bounds one call (None: the ToolSet's default)."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    timeout_s: float | None = None

    def call(self, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError(f"tool {self.name!r} implements neither call nor acall")

    async def acall(self, arguments: dict[str, Any]) -> Any:
        # A sync tool runs in a thread; a thread cannot be stopped, so after a timeout the call is
        # abandoned, not killed. Tools that may hang should run their work in a process (like `python`).
        return await asyncio.to_thread(self.call, arguments)

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it: `tokenizer.apply_chat_template(..., tools=[...])`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """One well-formed call parsed from the model's output."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""  # the text between <tool_call> and </tool_call>


@dataclass
class ToolCallError:
    """A <tool_call> block that could not be parsed; executing it gives an error result."""

    message: str
    raw: str = ""


@dataclass
class ToolResult:
    """The outcome of one call. `content` is what the model reads next; `error` says the call failed
    (kind: parse, unknown_tool, bad_arguments, timeout, exception) and is what rollouts count."""

    name: str
    content: str
    error: bool = False
    error_kind: str | None = None
    elapsed_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Parsing and formatting (Hermes / Qwen2.5 format)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL_HINT = 'Write each call as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.'


def _parse_one(raw: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}). "
                             f"{_CALL_HINT}", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCallError(f'the tool call must be a JSON object with a "name" string. {_CALL_HINT}', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments object as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(f'the "arguments" string of {obj["name"]} is not valid JSON ({e.msg}). '
                                 f"{_CALL_HINT}", raw)
    if not isinstance(args, dict):
        return ToolCallError(f'"arguments" of {obj["name"]} must be a JSON object, got {type(args).__name__}. '
                             f"{_CALL_HINT}", raw)
    return ToolCall(obj["name"], args, raw)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every <tool_call>...</tool_call> block of a model's output, in order. A block that is not a
    JSON object {"name": str, "arguments": object} (or whose closing tag is missing) becomes a
    ToolCallError, so the model is told instead of the call silently vanishing."""
    items: list[ToolCall | ToolCallError] = []
    pos = 0
    while (start := text.find(_OPEN, pos)) != -1:
        body_start = start + len(_OPEN)
        end = text.find(_CLOSE, body_start)
        if end == -1:
            items.append(ToolCallError(f"a <tool_call> is not closed with </tool_call>. {_CALL_HINT}",
                                       text[body_start:].strip()))
            break
        items.append(_parse_one(text[body_start:end].strip()))
        pos = end + len(_CLOSE)
    return items


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as the model writes it (and as Qwen2.5's template renders an assistant's tool_calls)."""
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}\n{_CLOSE}"


def tool_messages(results: Sequence[ToolResult]) -> list[dict[str, str]]:
    """The results as chat messages of role "tool", for `tokenizer.apply_chat_template` (preferred:
    the model's own template then decides the text)."""
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


def format_tool_responses(results: Sequence[ToolResult], turn_start: str = "<|im_start|>user",
                          turn_end: str = "<|im_end|>\n") -> str:
    """The text Qwen2.5's chat template renders for a run of tool messages: one user turn with each
    result in its own <tool_response> block. For loops that append text instead of re-templating."""
    body = "".join(f"\n<tool_response>\n{r.content}\n</tool_response>" for r in results)
    return f"{turn_start}{body}{turn_end}"


# ----------------------------------------------------------------------------------------------------
# Argument checking: the subset of JSON schema that function-calling schemas use

_JSON_TYPES: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def validate_arguments(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> list[str]:
    """Problems of `value` against `schema` (type, enum, required, properties, additionalProperties:
    false, items); [] when it fits. Other keywords are not checked."""
    problems: list[str] = []
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in allowed):
            return [f"{where} must be {' or '.join(allowed)}, got {type(value).__name__} {json.dumps(value)[:60]}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)[:60]}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{where}.{key} is required")
        for key, v in value.items():
            if key in props:
                problems += validate_arguments(v, props[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                problems.append(f"{where}.{key} is not a parameter (parameters: {', '.join(props) or 'none'})")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, v in enumerate(value):
            problems += validate_arguments(v, schema["items"], f"{where}[{i}]")
    return problems


# ----------------------------------------------------------------------------------------------------
# Execution


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def _trim(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolSet:
    """The tools of a rollout, by name. `execute` never raises: every failure is a ToolResult with
    error=True and a message for the model. Results longer than max_result_chars are cut in the middle."""

    def __init__(self, tools: Iterable[Tool], default_timeout_s: float = 30.0, max_result_chars: int = 4000):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"{t!r} is not a hpcrl.agents.tools.Tool")
            if not _TOOL_NAME.match(t.name) or t.name in self.tools:
                raise ValueError(f"tool names must be unique and match {_TOOL_NAME.pattern} (the function-calling "
                                 f"format's rule): {t.name!r}")
            self.tools[t.name] = t
        self.default_timeout_s = default_timeout_s
        self.max_result_chars = max_result_chars

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def _error(self, name: str, kind: str, message: str, t0: float) -> ToolResult:
        return ToolResult(name, _trim(f"Error: {message}", self.max_result_chars), True, kind, time.monotonic() - t0)

    async def execute(self, item: ToolCall | ToolCallError) -> ToolResult:
        """Run one parsed call."""
        t0 = time.monotonic()
        if isinstance(item, ToolCallError):
            return self._error("", "parse", item.message, t0)
        tool = self.tools.get(item.name)
        if tool is None:
            return self._error(item.name, "unknown_tool", f"unknown tool {item.name!r}; the tools are: "
                               f"{', '.join(self.tools) or 'none'}.", t0)
        problems = validate_arguments(item.arguments, tool.parameters)
        if problems:
            return self._error(item.name, "bad_arguments", f"invalid arguments for {item.name}: "
                               f"{'; '.join(problems)}.", t0)
        timeout = tool.timeout_s if tool.timeout_s is not None else self.default_timeout_s
        try:
            out = await asyncio.wait_for(tool.acall(dict(item.arguments)), timeout)
        except asyncio.TimeoutError:
            return self._error(item.name, "timeout", f"{item.name} did not finish within {timeout:g} s.", t0)
        except ToolError as e:
            return self._error(item.name, "exception", str(e), t0)
        except Exception as e:  # a tool's bug must not end the rollout
            return self._error(item.name, "exception", f"{item.name} failed: {type(e).__name__}: {e}", t0)
        metadata = {}
        if isinstance(out, ToolOutput):
            out, metadata = out.content, out.metadata
        return ToolResult(item.name, _trim(_as_text(out), self.max_result_chars), False, None,
                          time.monotonic() - t0, metadata)

    async def execute_all(self, items: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        """Run the calls of one turn concurrently; results in call order."""
        return list(await asyncio.gather(*(self.execute(i) for i in items)))

    def execute_sync(self, items: Sequence[ToolCall | ToolCallError]) -> list[ToolResult]:
        """`execute_all` for code without an event loop."""
        return asyncio.run(self.execute_all(items))


@dataclass
class ToolOutput:
    """A tool's return value with details for the rollout's metrics next to what the model reads."""

    content: str
    metadata: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Built-in tools


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
    max_output_chars (per stream in the answer) and max_concurrency (runs at a time in this process)."""

    name = "python"
    description = ("Run a Python 3 program and get what it prints. Each call is a fresh process with no "
                   "network and no state kept between calls; print the values you need.")
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the complete Python program"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, max_output_chars: int = 2000, max_concurrency: int | None = None, **sandbox_config: Any):
        from hpcrl.sandbox import Sandbox, SandboxConfig

        config = SandboxConfig(**{"wall_s": 10.0, "cpu_s": 5.0, **sandbox_config})
        self.sandbox = Sandbox(config, max_concurrency=max_concurrency)
        self.max_output_chars = max_output_chars
        # the sandbox's wall limit ends the program; the tool timeout is only a backstop above it
        self.timeout_s = config.wall_s + 10.0

    async def acall(self, arguments: dict[str, Any]) -> ToolOutput:
        r = await self.sandbox.run_async(arguments["code"])
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


# ----------------------------------------------------------------------------------------------------
# Loading from config

BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


def build_from_spec(spec: str | Mapping[str, Any], builtins: Mapping[str, type], base: type, what: str) -> Any:
    """An instance from a config entry: a built-in name, or {"class": "package.module:Class" or a
    built-in name, "kwargs": {...}}; the class must subclass `base`. ValueError naming what is wrong
    (`what`: "tool", "tool-call format"). Tools and tool-call formats are loaded alike."""
    if isinstance(spec, str):
        spec = {"class": spec}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("class"), str):
        raise ValueError(f"{what} {spec!r}: use a built-in name ({', '.join(builtins)}) or "
                         "{'class': 'package.module:Class', 'kwargs': {...}}")
    unknown = set(spec) - {"class", "kwargs"}
    if unknown:
        raise ValueError(f"{what} {dict(spec)!r}: unknown keys {sorted(unknown)} (allowed: class, kwargs)")
    target, kwargs = spec["class"], dict(spec.get("kwargs") or {})
    if target in builtins:
        cls: Any = builtins[target]
    else:
        module_name, _, attr = target.partition(":")
        if not module_name or not attr:
            raise ValueError(f"{what} {target!r}: use 'package.module:Class' or a built-in name "
                             f"({', '.join(builtins)})")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{what} {target!r}: cannot import {module_name!r} ({e})") from e
        cls = getattr(module, attr, None)
        if not (inspect.isclass(cls) and issubclass(cls, base)):
            raise ValueError(f"{what} {target!r}: {attr!r} is not a subclass of {base.__module__}.{base.__name__}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{what} {target!r}: bad kwargs {kwargs!r}: {e}") from e


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

