"""Load a YAML recipe onto the structured schema, apply `key=value` overrides, resolve.

Every failure becomes a `ConfigError` that names the key, the bad value and what is allowed, so
the CLI can print it and exit 2 before anything is allocated.
"""

from __future__ import annotations

import copy
import difflib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from hpcrl.config.schema import HpcrlConfig


class ConfigError(ValueError):
    """A configuration problem; `problems` holds one line per bad key."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _known_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            full = f"{prefix}{k}"
            keys.append(full)
            child = node._get_node(k)
            if isinstance(child, DictConfig) and not child._is_none():
                keys += _known_keys(child, full + ".")
    return keys


def _describe(err: OmegaConfBaseException, schema: DictConfig, origin: str) -> str:
    """Turn an OmegaConf error into one line that names the key and says what to do."""
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        close = difflib.get_close_matches(str(key), _known_keys(schema), n=3, cutoff=0.6)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        return (f"{key}: unknown key (from {origin}).{hint} "
                f"`hpcrl config CONFIG` prints every key with its default.")
    if isinstance(err, ValidationError):
        want = _expected_type(schema, str(key))
        return (f"{key}: {err.msg.splitlines()[0]} (from {origin})."
                + (f" Expected a value of type {want}." if want else ""))
    if isinstance(err, MissingMandatoryValue):
        return f"{key}: required but not set (from {origin}). Set it in the YAML or as {key}=VALUE."
    if isinstance(err, InterpolationResolutionError):
        return f"{key}: cannot resolve interpolation: {err.msg.splitlines()[0]} (from {origin})."
    return f"{key}: {err.msg.splitlines()[0] if err.msg else type(err).__name__} (from {origin})."


def _expected_type(schema: DictConfig, dotted: str) -> str | None:
    try:
        parent, _, leaf = dotted.rpartition(".")
        node = OmegaConf.select(schema, parent) if parent else schema
        child = node._get_node(leaf) if isinstance(node, DictConfig) else None
        t = child._metadata.ref_type if child is not None else None
        return getattr(t, "__name__", None) or (str(t) if t is not None else None)
    except Exception:  # a best-effort hint only
        return None


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any, str]]:
    """`a.b=value` -> (key, YAML-parsed value, original text); refuses anything not of that form."""
    parsed = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key or any(c.isspace() for c in key):
            raise ConfigError([f"{text!r}: not an override. Write KEY=VALUE, e.g. trainer.total_steps=10."])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # not YAML: take the text as it is (e.g. a path with a colon)
        parsed.append((key, value, text))
    return parsed


@functools.cache
def _schema() -> DictConfig:
    """The schema with its defaults, built once a process (OmegaConf.structured: ~40 ms, a deep copy ~6 ms).
    Read only: load_config copies it."""
    return OmegaConf.structured(HpcrlConfig)


def _nested(key: str, value: Any) -> dict[str, Any]:
    """`a.b.c`, v -> {"a": {"b": {"c": v}}}."""
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    return nested


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- overrides, type-checked and resolved.

    Interpolations such as ${trainer.run_dir} are resolved in place, so what is printed, saved
    with a checkpoint and handed to workers is exactly what runs.
    """
    schema = _schema()
    cfg = copy.deepcopy(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {str(path)!r} does not exist. Pass a YAML recipe, "
                               "e.g. configs/grpo_tiny.yaml."])
        try:
            data = OmegaConf.load(path)
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
        if not isinstance(data, DictConfig):
            raise ConfigError([f"{path}: the top level must be a mapping of sections (model:, actor:, ...)."])
        try:
            cfg = OmegaConf.merge(cfg, data)
        except OmegaConfBaseException as e:
            raise ConfigError([_describe(e, schema, str(path))]) from None

    parsed = parse_overrides(overrides)
    nested = [_nested(key, value) for key, value, _ in parsed]
    try:
        # merge, not update: it also fills an optional section that is still null
        # (reference.parallel.tensor_parallel=2) from its dataclass. All overrides in one merge: each
        # merge deep-copies the whole config (~10 ms), in order, as one merge after another would.
        cfg = OmegaConf.merge(cfg, *nested) if nested else cfg
    except OmegaConfBaseException:
        # one by one, to name every override that fails (the good ones still merged, for the next check)
        problems = []
        for (key, _, text), one in zip(parsed, nested, strict=True):
            try:
                cfg = OmegaConf.merge(cfg, one)
            except OmegaConfBaseException as e:
                if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
                    e.full_key = key  # name the whole key the user wrote, not just its first unknown part
                problems.append(_describe(e, schema, f"override {text!r}"))
        raise ConfigError(problems) from None

    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError([_describe(e, schema, "interpolation")]) from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"{k}: required but not set. Set it in the YAML or as {k}=VALUE." for k in missing])
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
