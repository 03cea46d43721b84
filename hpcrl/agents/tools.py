"""Tools a model can call during a multi-turn rollout: the interface, the call parser, the argument
checks, the executor and the result formatter. The two built-ins (`calculator`, `python`) and the
loader of a config's tool list are hpcrl.agents.builtin_tools.

Flow in a rollout loop (the loop itself lives elsewhere):

    tools = ToolSet(load_tools(["calculator", {"class": "python", "kwargs": {"wall_s": 5}}]))
    prompt = tokenizer.apply_chat_template(messages, tools=tools.schemas(), ...)   # tools in the prompt
    items = parse_tool_calls(completion)                     # <tool_call>{...}</tool_call> blocks
    results = await tools.execute_all(items)                 # never raises; errors are results
    text = format_tool_responses(results)                    # the next (user) turn, Qwen2.5/Hermes style
    n_errors = sum(r.error for r in results)                 # for the rollout's metrics

A tool that raises, times out or gets bad arguments gives a `ToolResult` with `error=True` and a
message written for the model ("Error: ..."), so the model can correct itself and the loop goes on.
Whatever the model writes (a `<tool_call>` nested a thousand deep, a 5000-digit integer) is parsed
into such an error, never an exception out of the loop.

Time: a call waits for a free slot of its tool (`Tool.try_acquire`: the python tool's sandbox slots,
a sync tool's threads) for at most `queue_timeout_s` (error kind "queue_timeout": the call was not
run), then its `timeout_s` starts. A sync tool's call runs in a thread of its own; a timed-out one
cannot be stopped and is left running (abandoned), but holds no slot: later calls get new threads,
and only when `max_hung_calls` abandoned calls of a tool are still running are its calls refused.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------------------------------------------
# Interface


class ToolError(Exception):
    """Raised by a tool for a failure whose message is meant for the model as it is (no traceback).
    `kind` is the ToolResult.error_kind it becomes."""

    def __init__(self, message: str, kind: str = "exception"):
        super().__init__(message)
        self.kind = kind


class _SyncCalls:
    """The threads of one sync tool: running calls, and abandoned (timed-out, still running) ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.hung = 0


_sync_calls_lock = threading.Lock()


class Tool:
    """A callable tool. Subclasses set `name`, `description` and `parameters` (a JSON schema of the
    arguments object, OpenAI function-calling format) and implement `call` (sync; run in a thread) or
    `acall` (async). Return a string (or anything JSON-serialisable); raise ToolError for a failure
    the model should read. `timeout_s` bounds one call (None: the ToolSet's default)."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    timeout_s: float | None = None
    # the longest a call waits for a free slot before it is answered "queue_timeout" (None: the ToolSet's)
    queue_timeout_s: float | None = None
    max_concurrent_calls: int = 32  # sync tools: calls running at once
    max_hung_calls: int = 64  # sync tools: abandoned calls still running beyond which calls are refused

    def call(self, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError(f"tool {self.name!r} implements neither call nor acall")

    def _sync_calls(self) -> _SyncCalls:
        with _sync_calls_lock:
            if "_calls" not in self.__dict__:
                self.__dict__["_calls"] = _SyncCalls()
            return self.__dict__["_calls"]

    def try_acquire(self) -> bool:
        """Take a slot for one call without waiting (False: none free now). ToolError("...",
        "unavailable") when calls cannot run at all. The default: a sync tool's thread."""
        calls = self._sync_calls()
        with calls.lock:
            if calls.hung >= self.max_hung_calls:
                raise ToolError(f"{self.name} is not available: {calls.hung} of its calls timed out and are still "
                                "running.", "unavailable")
            if calls.running >= self.max_concurrent_calls:
                return False
            calls.running += 1
            return True

    def release(self) -> None:
        """Give back the slot of a call that ended (the ToolSet calls it; done or timed out)."""
        calls = self._sync_calls()
        with calls.lock:
            calls.running -= 1

    async def acall(self, arguments: dict[str, Any]) -> Any:
        """A sync tool's call in a thread of its own. A thread cannot be stopped: after a timeout the
        call is abandoned (counted until it ends) and later calls get new threads. Tools that may hang
        for good should run their work in a process (like `python`)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        calls = self._sync_calls()
        state = {"abandoned": False}

        def deliver(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def work() -> None:
            try:
                value, ok = self.call(arguments), True
            except BaseException as e:
                value, ok = e, False
            with calls.lock:
                if state["abandoned"]:
                    calls.hung -= 1
                    return
                state["abandoned"] = None  # delivered: a cancel from now on abandons nothing
            try:
                loop.call_soon_threadsafe(deliver, ok, value)
            except RuntimeError:  # the loop is closed
                pass

        threading.Thread(target=work, name=f"hpcrl-tool-{self.name}", daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            with calls.lock:
                if state["abandoned"] is False:
                    state["abandoned"] = True
                    calls.hung += 1
            raise

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
    except RecursionError:
        return ToolCallError(f"the tool call is nested too deeply to read. {_CALL_HINT}", raw)
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        return ToolCallError(f"the tool call could not be read ({e}). {_CALL_HINT}", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCallError(f'the tool call must be a JSON object with a "name" string. {_CALL_HINT}', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments object as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(f'the "arguments" string of {obj["name"]} is not valid JSON ({e.msg}). '
                                 f"{_CALL_HINT}", raw)
        except (ValueError, RecursionError) as e:
            return ToolCallError(f'the "arguments" string of {obj["name"]} could not be read '
                                 f"({type(e).__name__}). {_CALL_HINT}", raw)
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

    def __init__(self, tools: Iterable[Tool], default_timeout_s: float = 30.0, max_result_chars: int = 4000,
                 default_queue_timeout_s: float = 60.0):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"{t!r} is not a hpcrl.agents.tools.Tool")
            if not _TOOL_NAME.match(t.name) or t.name in self.tools:
                raise ValueError(f"tool names must be unique and match {_TOOL_NAME.pattern} (the function-calling "
                                 f"format's rule): {t.name!r}")
            self.tools[t.name] = t
        self.default_timeout_s = default_timeout_s
        self.default_queue_timeout_s = default_queue_timeout_s
        self.max_result_chars = max_result_chars

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def _error(self, name: str, kind: str, message: str, t0: float) -> ToolResult:
        return ToolResult(name, _trim(f"Error: {message}", self.max_result_chars), True, kind, time.monotonic() - t0)

    async def execute(self, item: ToolCall | ToolCallError) -> ToolResult:
        """Run one parsed call."""
        t0 = time.monotonic()
        try:
            return await self._execute(item, t0)
        except (RecursionError, ValueError, TypeError) as e:  # checking what the model wrote: its error
            return self._error(getattr(item, "name", ""), "bad_arguments", f"the call could not be checked "
                               f"({type(e).__name__}).", t0)

    async def _execute(self, item: ToolCall | ToolCallError, t0: float) -> ToolResult:
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
        queue_timeout = tool.queue_timeout_s if tool.queue_timeout_s is not None else self.default_queue_timeout_s
        try:
            if not await self._acquire(tool, queue_timeout):
                return self._error(item.name, "queue_timeout", f"{item.name} was not run: it stayed busy with other "
                                   f"calls for {queue_timeout:g} s (not your call's doing; try again).", t0)
        except ToolError as e:
            return self._error(item.name, e.kind, str(e), t0)
        started = time.monotonic()  # the call's own time starts here, not while it waited for a slot
        try:
            out = await asyncio.wait_for(tool.acall(dict(item.arguments)), timeout)
        except asyncio.TimeoutError:
            return self._error(item.name, "timeout", f"{item.name} did not finish within {timeout:g} s.", t0)
        except ToolError as e:
            return self._error(item.name, e.kind, str(e), t0)
        except Exception as e:  # a tool's bug must not end the rollout
            return self._error(item.name, "exception", f"{item.name} failed: {type(e).__name__}: {e}", t0)
        finally:
            tool.release()
        metadata = {"queued_s": started - t0}
        if isinstance(out, ToolOutput):
            out, metadata = out.content, {**metadata, **out.metadata}
        return ToolResult(item.name, _trim(_as_text(out), self.max_result_chars), False, None,
                          time.monotonic() - t0, metadata)

    @staticmethod
    async def _acquire(tool: Tool, queue_timeout: float) -> bool:
        """Wait for a slot of `tool` (polled: slots are shared with threads and other event loops)."""
        end = time.monotonic() + queue_timeout
        pause = 0.002
        while not tool.try_acquire():
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(min(pause, max(0.0, end - time.monotonic())))
            pause = min(pause * 2, 0.02)
        return True

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
# Loading from config (tools here, tool-call formats in hpcrl.agents.formats)


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
