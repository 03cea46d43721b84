"""Final-answer extraction from a model's completion.

Order, first hit wins: the GSM8K marker (`#### N`, the last one in the text), then the last
`\\boxed{...}` (or `\\fbox{...}`), then, as a lenient fallback, the last number anywhere in the text.
The fallback exists so that a model which answers correctly without the marker still gets accuracy
credit; the format reward (see `builtin.py`) is what pays for using the marker.
"""

from __future__ import annotations

import re

# A number as people write it: sign only when it is not a minus between operands ("10-4" is not -4),
# thousands commas (1,000; never "1,2"), decimals, an optional fraction "a/b" and percent sign.
NUMBER = (
    r"(?:(?<![\w)\]}])[-+])?"
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*\d+(?:\.\d+)?)?"
    r"(?:\s*\\?%)?"
)
_NUMBER_RE = re.compile(NUMBER)
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")


def last_number(text: str) -> str | None:
    """The last number in `text` (the lenient fallback), or None."""
    found = _NUMBER_RE.findall(text)
    return found[-1].strip() if found else None


def hash_answer(text: str) -> str | None:
    """What follows the last `####` on its line: the leading number when there is one ("#### $1,200."
    gives "1,200"), else the stripped remainder (a symbolic answer); None without a marker or when
    nothing follows it."""
    found = _HASH_RE.findall(text)
    if not found:
        return None
    rest = found[-1].strip()
    rest = rest.lstrip("$ ").rstrip(". ")
    m = _NUMBER_RE.match(rest)
    if m:
        return m.group(0).strip()
    return rest or None


def boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced), or of `\\boxed 5`; None
    when there is none or its braces never close (a truncated answer)."""
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":  # "\boxed 5": up to the next space or '$'
        return re.split(r"[\s$]", text[i:], maxsplit=1)[0] or None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip() or None
    return None


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, method): method is "hash", "boxed", "last_number" or "none" (answer None)."""
    for method, fn in (("hash", hash_answer), ("boxed", boxed_answer), ("last_number", last_number)):
        answer = fn(text)
        if answer is not None:
            return answer, method
    return None, "none"


def is_number(text: str) -> bool:
    """True when all of `text` is one number in the forms `NUMBER` accepts."""
    return _NUMBER_RE.fullmatch(text.strip()) is not None
