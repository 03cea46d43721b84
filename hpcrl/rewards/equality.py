"""Is a predicted answer equal to the ground truth?

Numbers first, exactly: both sides parse to rationals (thousands commas, trailing ".0", "a/b",
`\\frac{a}{b}`, percent, "$" are understood), and when both do, that comparison decides, so the common
case never touches a CAS. Anything else goes to a symbolic check: math-verify when it is installed
(the reference grader for MATH-style answers), else a small sympy fallback (plain expressions and simple
LaTeX: \\frac, \\sqrt, \\cdot, ^). Symbolic checks run inside the reward workers, under the scorer's
per-sample timeout; before them, an answer whose numbers would grow past MAX_DIGITS digits (a tower
like `9^{9^{9}}`, which a CAS tries to compute, a factorial of a huge number) is refused at once: it is
equal to the ground truth only as text. The bound is on the expression, not a clock, so the verdict
does not depend on how busy the node is.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
from dataclasses import dataclass
from fractions import Fraction

from hpcrl.rewards.extract import NUMBER

# Optional, the better symbolic grader. Looked up, not imported: importing it takes ~1 s, and only the
# reward workers ever call it.
HAVE_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None

_NUMBER_FULL = re.compile(rf"\s*{NUMBER}\s*")
_FRAC = re.compile(r"^\\[dt]?frac\{\s*([-+]?\d+(?:\.\d+)?)\s*\}\{\s*([-+]?\d+(?:\.\d+)?)\s*\}$")
_FRAC_SHORT = re.compile(r"^\\[dt]?frac(\d)(\d)$")
_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{[^{}]*\}")


@dataclass(frozen=True)
class Number:
    value: Fraction
    percent: bool


def _strip_wrappers(s: str) -> str:
    s = s.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()
    s = _TEXT.sub("", s)  # units: "18 \text{ dollars}"
    for junk in ("\\!", "\\,", "\\;", "\\ ", "{,}", "^\\circ", "^{\\circ}", "\\$", "$"):
        s = s.replace(junk, "" if junk != "{,}" else ",")
    return s.strip().rstrip(".").strip()


def parse_number(text: str) -> Number | None:
    """`text` as an exact rational (with a percent flag), or None when it is not a plain number."""
    s = _strip_wrappers(text)
    s = s.replace("\\%", "%")
    m = _FRAC.match(s) or _FRAC_SHORT.match(s)
    if m:
        num, den = Fraction(m.group(1)), Fraction(m.group(2))
        return Number(num / den, False) if den != 0 else None
    if not _NUMBER_FULL.fullmatch(s):
        return None
    percent = s.endswith("%")
    s = s.rstrip("% ").replace(",", "").replace(" ", "")
    try:
        if "/" in s:
            num, den = s.split("/")
            if Fraction(den) == 0:
                return None
            return Number(Fraction(num) / Fraction(den), percent)
        return Number(Fraction(s), percent)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: Number, b: Number) -> bool:
    """Exact equality; a percent on either side may also be read as a fraction ("50%" == "0.5"), and
    the bare number stays valid ("50%" == "50", GSM8K writes percentages without the sign)."""
    if a.value == b.value:
        return True
    if a.percent and a.value / 100 == b.value:
        return True
    return b.percent and b.value / 100 == a.value


def _normalize_text(s: str) -> str:
    return re.sub(r"\s+", "", _strip_wrappers(s)).lower()


def answers_equal(pred: str, gold: str) -> bool:
    """The full check used by the builtin scorer: text, then numbers (decisive), then symbolic."""
    if pred is None or gold is None:
        return False
    if _normalize_text(pred) == _normalize_text(gold) and _normalize_text(gold):
        return True
    p, g = parse_number(pred), parse_number(gold)
    if p is not None and g is not None:
        return numbers_equal(p, g)
    return symbolic_equal(pred, gold)


MAX_DIGITS = 10_000
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|([A-Za-z_]+)|(\*\*|[-+*/()!,]))")


class _Magnitude:
    """An upper bound on log10 of the size of every number an expression computes, over its plain
    form (`_latex_to_plain`): numbers, names (symbols: unknown), + - * / ** !, parentheses, implicit
    products. Parsing is lenient: a character it does not know ends a term. `too_big` is set as soon
    as a power or factorial with known operands would pass MAX_DIGITS digits."""

    def __init__(self, text: str):
        self.tokens = [m for m in _TOKEN.finditer(text)]
        self.i = 0
        self.too_big = False

    def peek(self) -> str | None:
        if self.i >= len(self.tokens):
            return None
        m = self.tokens[self.i]
        return m.group(3) or ("num" if m.group(1) else "name")

    def expr(self, depth: int = 0) -> float | None:
        if depth > 200:
            self.too_big = True  # nested beyond reason: not worth a CAS's time
            return None
        mags = [self.term(depth)]
        while self.peek() in ("+", "-", ","):
            self.i += 1
            mags.append(self.term(depth))
        return None if None in mags else max(mags) + 0.31  # log10(2): a sum at most doubles

    def term(self, depth: int) -> float | None:
        mags = [self.factor(depth)]
        while self.peek() in ("*", "/", "num", "name", "("):
            if self.peek() in ("*", "/"):
                self.i += 1
            mags.append(self.factor(depth))
        return None if None in mags else sum(mags)

    def factor(self, depth: int) -> float | None:
        base = self.unary(depth)
        if self.peek() != "**":
            return base
        self.i += 1
        exponent = self.factor(depth + 1)
        if base is None or exponent is None:
            return None
        if base <= 0.31:  # |base| <= 1 (or 2 after rounding up): no growth worth bounding
            return base
        digits = 10 ** min(exponent, 300) * base
        if exponent > 300 or digits > MAX_DIGITS:
            self.too_big = True
        return digits

    def unary(self, depth: int) -> float | None:
        while self.peek() in ("-", "+"):
            self.i += 1
        value = self.atom(depth)
        while self.peek() == "!":
            self.i += 1
            if value is not None:
                n = 10 ** min(value, 300)
                if value > 300 or n * max(math.log10(n), 1.0) > MAX_DIGITS:
                    self.too_big = True
                value = n * max(math.log10(n), 1.0)
        return value

    def atom(self, depth: int) -> float | None:
        kind = self.peek()
        if kind is None:
            return 0.0
        m = self.tokens[self.i]
        self.i += 1
        if kind == "num":
            return math.log10(float(m.group(1)) + 1.0)
        if kind == "name":
            return None
        if kind == "(":
            value = self.expr(depth + 1)
            if self.peek() == ")":
                self.i += 1
            return value
        return 0.0  # a stray operator: skip it


def too_big_to_compare(answer: str) -> bool:
    """Whether some number in `answer` (LaTeX or plain) would have more than MAX_DIGITS digits."""
    plain = _latex_to_plain(answer)
    if len(plain) > 10_000:
        return True
    parser = _Magnitude(plain)
    while parser.i < len(parser.tokens) and not parser.too_big:
        before = parser.i
        parser.expr()
        if parser.i == before:
            parser.i += 1
    return parser.too_big


def symbolic_equal(pred: str, gold: str, backend: str = "auto") -> bool:
    """Symbolic equivalence; backend "auto" (math-verify when installed), "math_verify" or "sympy".
    Never raises on unparseable input: that is a wrong answer, not an error. An answer that
    `too_big_to_compare` is not equal (answers_equal has compared the texts already)."""
    if too_big_to_compare(pred) or too_big_to_compare(gold):
        return False
    if backend == "math_verify" or (backend == "auto" and HAVE_MATH_VERIFY):
        return _math_verify_equal(pred, gold)
    return _sympy_equal(pred, gold)


def _drop_disabled_timeout_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


_quiet = False


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    global _quiet
    if not _quiet:  # its notice that we bound the time ourselves: we do
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_drop_disabled_timeout_notice)
        _quiet = True
    # No internal timeouts: math-verify's SIGALRM ones (5 s) turn a slow check on a busy node into a
    # silent wrong answer. The scorer's per-sample timeout (reward.timeout_s) bounds it instead, and a
    # timeout there is counted in reward/timeouts.
    g = parse(f"${_strip_wrappers(gold)}$", parsing_timeout=None)
    p = parse(f"${_strip_wrappers(pred)}$", parsing_timeout=None)
    if not g or not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


_LATEX_REWRITES = [
    (re.compile(r"\\left|\\right"), ""),
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"((\1)/(\2))"),
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\pi"), "pi"),
]


def _latex_to_plain(s: str) -> str:
    s = _strip_wrappers(s)
    for _ in range(4):  # nested \frac{\sqrt{2}}{2}: rewrite innermost first, a few rounds
        for pattern, repl in _LATEX_REWRITES:
            s = pattern.sub(repl, s)
    return s.replace("{", "(").replace("}", ")").replace("^", "**")


# parse_expr evaluates Python: a model's answer reaches it only when it is made of these characters and
# names (single letters are variables), so an answer can never call anything but sqrt.
_SAFE_CHARS = re.compile(r"^[0-9A-Za-z+\-*/().,\s]*$")
_SAFE_NAMES = {"sqrt", "pi"}


def _safe_for_sympy(s: str) -> bool:
    if not s.strip() or not _SAFE_CHARS.match(s):
        return False
    return all(len(name) == 1 or name in _SAFE_NAMES for name in re.findall(r"[A-Za-z]+", s))


def _sympy_equal(pred: str, gold: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    tr = standard_transformations + (implicit_multiplication_application, convert_xor)
    pred_s, gold_s = _latex_to_plain(pred), _latex_to_plain(gold)
    if not (_safe_for_sympy(pred_s) and _safe_for_sympy(gold_s)):
        return False
    try:
        a = parse_expr(pred_s, transformations=tr, evaluate=True)
        b = parse_expr(gold_s, transformations=tr, evaluate=True)
        return bool(sympy.simplify(a - b) == 0)
    except Exception:  # unparseable or incomparable (sets vs numbers...): not equal
        return False
