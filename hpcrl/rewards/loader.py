"""Resolve `reward.function` ("builtin" or "package.module:function") to a callable.

Done in the controller when the scorer is built, so a typo fails the run before any allocation or
training, with a message that names the config key; the workers resolve it again in their own process.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

KEY = "reward.function"


def resolve_function(spec: str) -> Callable:
    """The function `spec` names; ValueError saying what is wrong and what to do otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{KEY}={spec!r}: use 'builtin' or 'package.module:function' (one colon between the "
                         "importable module and the function name), e.g. hpcrl.rewards.toy:digit_fraction.")
    module_name, attr = (p.strip() for p in spec.split(":"))
    if not module_name or not attr:
        raise ValueError(f"{KEY}={spec!r}: both the module and the function name are needed: "
                         "'package.module:function'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{KEY}={spec!r}: cannot import module {module_name!r} ({e}). Put the module on "
                         "PYTHONPATH (on every node) or install its package.") from e
    except Exception as e:
        raise ValueError(f"{KEY}={spec!r}: importing module {module_name!r} raised "
                         f"{type(e).__name__}: {e}. Fix the module.") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{KEY}={spec!r}: module {module_name!r} has no attribute {attr!r}. Check the "
                             "function name after the colon.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{KEY}={spec!r}: {attr!r} is a {type(obj).__name__}, not a function. Name a function "
                         "fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict.")
    try:
        inspect.signature(obj).bind("ds", "solution", "truth", extra_info=None)
    except TypeError as e:
        raise ValueError(f"{KEY}={spec!r}: cannot be called as fn(data_source, solution_str, ground_truth, "
                         f"extra_info=None): {e}. Give it that signature (verl's).") from e
    except ValueError:  # no signature available (some builtins / C functions): let the call decide
        pass
    return obj
