"""The layering of hpcrl's packages (docs/architecture.md), read from the source with `ast`: no module
is imported. A package may not import the packages listed against it below, at module level or inside a
function (a lazy import is still a dependency), and no two modules may import each other through any
chain (an import circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE_ROOT = REPO / "hpcrl"

# package -> the hpcrl packages it must not import (issue 43's rules; docs/architecture.md says why)
FORBIDDEN: dict[str, frozenset[str]] = {
    "config": frozenset({"engines", "data", "rewards", "agents", "sandbox", "workers", "trainer", "controller"}),
    "engines": frozenset({"controller", "trainer", "workers", "algos"}),
    "algos": frozenset({"controller", "engines"}),
    "controller": frozenset({"workers", "trainer", "engines"}),
    "data": frozenset({"engines", "controller"}),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def hpcrl_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The hpcrl modules that `name` imports (the most specific known module of each import)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # hpcrl.x.y.func -> hpcrl.x.y
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hpcrl"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if not module.startswith("hpcrl"):
                continue
            for alias in node.names:  # `from hpcrl.x import y`: y may be a module
                full = f"{module}.{alias.name}"
                add(full if full in known else module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = hpcrl_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        banned = FORBIDDEN.get(package_of(module), frozenset())
        for target in sorted(targets):
            if package_of(target) in banned:
                out.append(f"{module} imports {target} ({package_of(module)} must not import {package_of(target)})")
    return out


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_the_checker_sees_a_forbidden_import_and_a_circle() -> None:
    """The control: a graph with one forbidden edge and one circle is reported as such."""
    graph = {"hpcrl.config.schema": {"hpcrl.engines.megatron.lora"}, "hpcrl.engines.megatron.lora": set(),
             "hpcrl.cli": {"hpcrl.cli_slurm"}, "hpcrl.cli_slurm": {"hpcrl.cli"}}
    assert layering_violations(graph) == [
        "hpcrl.config.schema imports hpcrl.engines.megatron.lora (config must not import engines)"]
    assert import_circles(graph) == [["hpcrl.cli", "hpcrl.cli_slurm"]]
    # and the reader finds lazy imports inside functions (the real graph has some)
    graph = import_graph()
    assert len(graph) > 50 and "hpcrl.config.schema" in graph["hpcrl.config"], graph["hpcrl.config"]


def test_packages_import_only_what_their_layer_allows() -> None:
    problems = layering_violations(import_graph())
    assert not problems, "imports across the layering (docs/architecture.md):\n  " + "\n  ".join(problems)


def test_no_import_circles() -> None:
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)
