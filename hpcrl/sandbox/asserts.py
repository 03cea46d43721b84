"""Assert-style test cases (`["assert add(2, 3) == 5", ...]`) without trusting the solution's process.

Run in the solution's own interpreter, asserts can be passed without solving the task: a result whose
`__eq__` is always true, an `atexit` or `sys.excepthook` that prints the end marker read from the
program's own source. So each case is split in two processes:

1. The solution's run (`server_program`): the solution, the case's imports, then only the parts of
   the assert that need the solution (`add(2, 3)`), each evaluated and written out as data of exact
   built-in types (int, float, complex, str, bytes, bool, None, list, tuple, dict, set, frozenset;
   anything else, a subclass included, is an error). Expected values and comparisons never reach it.
2. The harness (`harness_program`, one run per sample, no solution code in it): the values rebuilt as
   genuine built-ins, substituted into the assert, and the assert run; `==` / `!=` compare strictly
   (equal types all the way down: `True` is not `1`, `4.0` is not `4`). It prints the verdicts.

Which parts go to the solution (`plan_case`): an expression that uses a name the case does not bind
itself (not a built-in, not imported by the case) is the solution's. Comparisons, `and`/`or`/`not`,
conditional expressions, and the arguments of a call to a harness function (`math.isclose(f(x), 3.14)`)
are split, so that a literal beside the solution's value stays with the harness; a call of the
solution's own function goes whole (its arguments are its inputs). Supported statements: `assert` and
`import`; anything else is a malformed test case (ValueError).
"""

from __future__ import annotations

import ast
import builtins
import json
import secrets
from dataclasses import dataclass

_BUILTIN_NAMES = frozenset(dir(builtins))
VALUES = "__hpcrl_v"  # the harness's list of the solution's values
STRICT_EQ = "__hpcrl_eq"


@dataclass(frozen=True)
class CasePlan:
    """One assert case: the imports (run on both sides), the expressions evaluated in the solution's
    process, and the asserts as the harness runs them (those expressions replaced by VALUES[i])."""

    imports: str
    units: tuple[str, ...]
    harness: str


def _free_names(node: ast.AST) -> set[str]:
    loads, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return loads - bound


class _Splitter(ast.NodeTransformer):
    def __init__(self, harness_names: set[str]):
        self.harness_names = harness_names
        self.units: list[str] = []

    def touches(self, node: ast.AST) -> bool:
        return bool(_free_names(node) - self.harness_names)

    def whole(self, node: ast.AST) -> bool:
        """Whether `node` may be evaluated in the solution's process as a whole: it needs the solution
        and holds no part that is only the harness's (a literal, an expected value)."""
        if isinstance(node, (ast.Compare, ast.BoolOp, ast.IfExp, ast.Constant)) or not self.touches(node):
            return False
        if isinstance(node, ast.Call):
            if self.touches(node.func):
                return True
            args = [a.value if isinstance(a, ast.Starred) else a for a in node.args]
            return all(self.whole(a) for a in args + [k.value for k in node.keywords])
        if isinstance(node, ast.BinOp):
            return self.whole(node.left) and self.whole(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.whole(node.operand)
        if isinstance(node, ast.Subscript):
            return self.whole(node.value) and self.whole(node.slice)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return all(self.whole(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return all(k is not None and self.whole(k) for k in node.keys) and all(self.whole(v) for v in node.values)
        return True  # a name, an attribute of the solution's value, a comprehension, a lambda, ...

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and self.whole(node):
            self.units.append(ast.unparse(node))
            return ast.Subscript(ast.Name(VALUES, ast.Load()), ast.Constant(len(self.units) - 1), ast.Load())
        if isinstance(node, ast.expr) and not self.touches(node):
            return node
        node = self.generic_visit(node)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            call = ast.Call(ast.Name(STRICT_EQ, ast.Load()), [node.left, node.comparators[0]], [])
            return call if isinstance(node.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
        return node


def plan_case(statement: str) -> CasePlan:
    """Split one test case (assert and import statements); ValueError for anything else."""
    try:
        tree = ast.parse(statement)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"assert test case is not Python ({e}): {statement[:100]!r}") from None
    imports, asserts = [], []
    harness_names = set(_BUILTIN_NAMES)
    for st in tree.body:
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(st))
            harness_names |= {(a.asname or a.name).split(".")[0] for a in st.names}
        elif isinstance(st, ast.Assert):
            asserts.append(st)
        else:
            raise ValueError(f"assert test cases may hold assert and import statements only, not "
                             f"{type(st).__name__}: {ast.unparse(st)[:100]!r}")
    if not asserts:
        raise ValueError(f"assert test case without an assert: {statement[:100]!r}")
    splitter = _Splitter(harness_names)
    lines = []
    for st in asserts:
        test = splitter.visit(st.test)
        lines.append(ast.unparse(ast.Assert(test, None)))
    return CasePlan("\n".join(imports), tuple(splitter.units), "\n".join(lines))


# ----------------------------------------------------------------------------------------------------
# The solution's side: evaluate the units, write each as tagged JSON on a line of its own

_SERVER = '''
import json as _hpcrl_json, os as _hpcrl_os, sys as _hpcrl_sys
_hpcrl_write, _hpcrl_dumps = _hpcrl_os.write, _hpcrl_json.dumps
_hpcrl_sys.set_int_max_str_digits(0)


def _hpcrl_encode(v, depth=0, _type=type, _len=len, _sorted=sorted, _repr=repr):
    if depth > 100:
        raise ValueError("nested more than 100 deep")
    t = _type(v)
    if t is bool:
        return ["b", v]
    if v is None:
        return ["n"]
    if t is int:
        return ["i", hex(v)]
    if t is float:
        return ["f", v.hex()]
    if t is complex:
        return ["c", v.real.hex(), v.imag.hex()]
    if t is str:
        return ["s", v]
    if t is bytes:
        return ["y", v.hex()]
    if t is list or t is tuple or t is set or t is frozenset:
        items = list(v)
        if t is set or t is frozenset:
            items = _sorted(items, key=_repr)
        return [{list: "l", tuple: "t", set: "S", frozenset: "F"}[t], [_hpcrl_encode(x, depth + 1) for x in items]]
    if t is dict:
        return ["d", [[_hpcrl_encode(k, depth + 1), _hpcrl_encode(x, depth + 1)] for k, x in v.items()]]
    raise TypeError(f"returned a {t.__name__}, not plain data (int, float, str, list, dict, ...)")

'''
_SERVER_RUN = '''
exec(compile(_hpcrl_source, "solution.py", "exec"), globals())
{imports}
for _hpcrl_k, _hpcrl_expr in enumerate(_hpcrl_units):
    try:
        _hpcrl_out = _hpcrl_encode(eval(_hpcrl_expr, globals()))
    except BaseException as _hpcrl_e:
        _hpcrl_out = ["x", type(_hpcrl_e).__name__]
    _hpcrl_write(1, (_hpcrl_nonce + " " + str(_hpcrl_k) + " " + _hpcrl_dumps(_hpcrl_out) + "\\n").encode())
'''


def server_program(solution: str, plan: CasePlan) -> tuple[str, str]:
    """(source, nonce): the program run in the solution's process for one case, and the prefix of its
    result lines (to tell them from what the solution prints itself)."""
    nonce = f"hpcrl-value-{secrets.token_hex(6)}"
    data = (f"_hpcrl_source = {solution!r}\n_hpcrl_units = {list(plan.units)!r}\n_hpcrl_nonce = {nonce!r}\n")
    return _SERVER + data + _SERVER_RUN.replace("{imports}", plan.imports), nonce


def read_values(stdout: str, nonce: str, count: int) -> list | None:
    """The solution's encoded values for one case, in order; None if one is missing or failed."""
    found: dict[int, object] = {}
    for line in stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        _, k, payload = line.split(" ", 2)
        try:
            found.setdefault(int(k), json.loads(payload))
        except (ValueError, RecursionError):
            return None
    values = [found.get(k) for k in range(count)]
    if any(not isinstance(v, list) or not v or v[0] == "x" for v in values):
        return None
    return values


# ----------------------------------------------------------------------------------------------------
# The harness: no solution code; values rebuilt with exact types, asserts run, verdicts printed

_HARNESS = '''
import json, sys
sys.set_int_max_str_digits(0)
CASES = CASES_HERE
CONTAINERS = {"l": list, "t": tuple, "S": set, "F": frozenset}


def decode(x):
    tag = x[0]
    if tag == "b" and type(x[1]) is bool:
        return x[1]
    if tag == "n":
        return None
    if tag == "i":
        return int(x[1], 16)
    if tag == "f":
        return float.fromhex(x[1])
    if tag == "c":
        return complex(float.fromhex(x[1]), float.fromhex(x[2]))
    if tag == "s" and type(x[1]) is str:
        return x[1]
    if tag == "y":
        return bytes.fromhex(x[1])
    if tag in CONTAINERS:
        return CONTAINERS[tag](decode(e) for e in x[1])
    if tag == "d":
        return {decode(k): decode(v) for k, v in x[1]}
    raise ValueError(f"not a value: {str(x)[:80]}")


def strict_eq(a, b):
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(strict_eq(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(strict_eq(a[k], b[k]) for k in a)
    if type(a) in (set, frozenset):
        return a == b and sorted(type(x).__name__ for x in a) == sorted(type(x).__name__ for x in b)
    return a == b


values = json.loads(sys.stdin.read())
for k, (imports, asserts) in enumerate(CASES):
    if values[k] is None:
        print(k, "fail")
        continue
    try:
        ns = {"VALUES": [decode(v) for v in values[k]], "STRICT_EQ": strict_eq}
        exec(imports + "\\n" + asserts, ns)
        print(k, "pass")
    except AssertionError:
        print(k, "fail")
    except Exception as e:
        print(k, "fail", type(e).__name__)
'''.replace('"VALUES"', repr(VALUES)).replace('"STRICT_EQ"', repr(STRICT_EQ))


def harness_program(plans: list[CasePlan]) -> str:
    """The program that judges every case of a sample; stdin: json list (per case) of the values
    read_values gave, or null."""
    return _HARNESS.replace("CASES_HERE", repr([(p.imports, p.harness) for p in plans]))


def read_verdicts(stdout: str, count: int) -> list[bool]:
    passed = [False] * count
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) < count:
            passed[int(parts[0])] = parts[1] == "pass"
    return passed
