"""docs/config.md, generated from the dataclasses of schema.py: every key with its type, default,
allowed values and meaning (`python tools/gen_config_docs.py` writes it; CI checks it is current).

Meanings are the comments in schema.py, read with `tokenize`: the comment lines right above a field
and the comment at the end of its line; a section's text is its class docstring. Why comments and not
field metadata: schema.py stays a plain, readable list of keys, which is what people read first.
Allowed values and ranges come from validate.py's CHOICES and RANGES, so the page says what the
validation enforces.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import tokenize
import types
import typing
from dataclasses import MISSING as DC_MISSING
from typing import Any

from omegaconf import MISSING

from hpcrl.config import schema
from hpcrl.config.validate import CHOICES, RANGES

GENERATOR = "python tools/gen_config_docs.py"


def _comments_by_line(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments(module: types.ModuleType = schema) -> dict[str, dict[str, str]]:
    """{class name: {field name: its comment text}} for every dataclass field of `module` that has one."""
    source = inspect.getsource(module)
    lines = source.splitlines()
    comments = _comments_by_line(source)
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            trailing = comments.get(stmt.end_lineno or stmt.lineno, "")
            text = " ".join(part for part in (*above, trailing) if part)
            if text:
                fields[stmt.target.id] = text
        out[node.name] = fields
    return out


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass of a field's type: `X`, `X | None`."""
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _default_text(value: Any) -> str:
    if value == MISSING:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


def _allowed(key: str) -> str:
    if key in CHOICES:
        return " \\| ".join("null" if c is None else c for c in CHOICES[key])
    if key in RANGES:
        lo, hi, lo_inclusive = RANGES[key]
        parts = []
        if lo is not None:
            parts.append(f"{'>=' if lo_inclusive else '>'} {lo:g}")
        if hi is not None:
            parts.append(f"<= {hi:g}")
        return " and ".join(parts)
    return ""


@dataclasses.dataclass
class KeyDoc:
    key: str
    type: str
    default: str
    allowed: str
    meaning: str


def _cell(text: str) -> str:
    """Text for a Markdown table cell: `|` would end the cell, `<x>` read as HTML, `*` as emphasis."""
    for char, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*"), ("\n", " ")):
        text = text.replace(char, escaped)
    return text


def _first_paragraph(doc: str | None) -> str:
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


def collect(cls: type = schema.HpcrlConfig, prefix: str = "", instance: Any = None,
            comments: dict[str, dict[str, str]] | None = None) -> list[KeyDoc]:
    """Every key under `cls` (dotted paths, nested dataclasses expanded), with its default taken from
    `instance` (the parent's default: `critic.optim` has lr 1e-5) or the class's own defaults."""
    comments = comments if comments is not None else field_comments()
    hints = typing.get_type_hints(cls)
    instance = instance if instance is not None else cls()
    docs: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        meaning = comments.get(cls.__name__, {}).get(f.name, "")
        value = getattr(instance, f.name)
        nested = _dataclass_in(tp)
        if nested is not None:
            optional = value is None
            docs.append(KeyDoc(key, f"section ({nested.__name__})" + (" or null" if optional else ""),
                               "null" if optional else "see below", "",
                               meaning or _first_paragraph(nested.__doc__)))
            docs += collect(nested, f"{key}.", value if value is not None else None, comments)
            continue
        if f.default is DC_MISSING and f.default_factory is DC_MISSING:  # never in the schema
            raise ValueError(f"{key}: no default")
        docs.append(KeyDoc(key, _type_name(tp), _default_text(value), _allowed(key), meaning))
    return docs


def render() -> str:
    """The whole of docs/config.md."""
    comments = field_comments()
    out = [
        "# Config reference",
        "",
        f"<!-- generated by `{GENERATOR}` from hpcrl/config/schema.py (meanings: its comments) and "
        "hpcrl/config/validate.py (allowed values); do not edit by hand -->",
        "",
        "Every key of an hpcrl config: the YAML recipe's sections, or `KEY=VALUE` overrides on the command line "
        "(`hpcrl run configs/grpo_tiny.yaml trainer.total_steps=3`). `hpcrl config CONFIG` prints a config with "
        "every key resolved. `${a.b}` in a default is an interpolation of another key. Values outside "
        "*allowed* are refused before anything starts (exit 2, naming the key).",
        "",
    ]
    top_hints = typing.get_type_hints(schema.HpcrlConfig)
    root = schema.HpcrlConfig()
    for f in dataclasses.fields(schema.HpcrlConfig):
        cls = _dataclass_in(top_hints[f.name])
        assert cls is not None
        out += [f"## `{f.name}`", ""]
        intro = _first_paragraph(cls.__doc__)
        if intro:
            out += [intro, ""]
        out += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for d in collect(cls, f"{f.name}.", getattr(root, f.name), comments):
            out.append(f"| `{d.key}` | {_cell(d.type)} | {_cell(d.default)} | {d.allowed} | {_cell(d.meaning)} |")
        out.append("")
    return "\n".join(out)


def undocumented() -> list[str]:
    """Keys without a meaning (a comment in schema.py)."""
    return [d.key for d in collect() if not d.meaning]
