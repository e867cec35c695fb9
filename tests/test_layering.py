"""Imports follow the data flow: probe -> observer -> logger -> backend, core underneath, gin and demos at the edge.

Every module under instrument/ is parsed with `ast` (nothing is imported to find its imports), and each import is
classified as top-level (runs at import time), lazy (inside a function: runs when called) or type-only (under
``if TYPE_CHECKING:``, never runs; ignored). The rules, checked on top-level and lazy imports alike:

- ``probes/`` and ``core/`` import nothing above them (``errors`` and ``checks`` sit below every layer);
- ``observers/`` import only ``core/``, ``probes/``, ``errors`` and ``checks``;
- ``logger/`` does not import the session, RL, config, demos, CLI or observers;
- ``backends/`` never import the session, RL, config, demos or CLI, nor anything upstream of them
  (logger, observers, probes, monitors): the logger hands them host records;
- ``terminal/`` (rendering) imports nothing but ``errors``, ``checks`` and itself: backends use it, not the other
  way round;
- ``checks`` (the shared argument checks) imports no layer at all, only ``errors``;
- nothing in the library imports the demos (shipped .gin files import them), the config package included;
- only the gin edge (the config package, the CLI, the demos) imports gin;
- the module graph is acyclic, lazy imports included (a lazy import that closes a cycle must be listed, with its
  reason, in ALLOWED_LAZY_CYCLE_EDGES);
- and, while at it, no module is over 500 lines.

All violations are collected and reported at once. Violations known on this branch, which other issue-12 branches
remove, are listed in KNOWN_VIOLATIONS: each is also a strict xfail, so once it is gone that test fails and the
entry must be deleted.
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import instrument

ROOT = Path(instrument.__file__).resolve().parent
PACKAGE = "instrument"

# First component below `instrument` -> the layer name used by the rules; the root package itself is "root"
# (importing it imports everything, so nothing below the session may import it).
EVERYTHING_ABOVE_CORE = {
    "observers", "logger", "backends", "terminal", "monitors", "session", "rl", "config", "demos", "cli",
    "__main__", "root",
}
FORBIDDEN: Dict[str, Set[str]] = {
    "probes": EVERYTHING_ABOVE_CORE,
    "core": EVERYTHING_ABOVE_CORE | {"probes"},
    "observers": EVERYTHING_ABOVE_CORE - {"observers"},
    "logger": {"session", "rl", "config", "demos", "cli", "__main__", "observers", "root"},
    "backends": {"session", "rl", "config", "demos", "cli", "__main__", "root", "logger", "observers", "probes",
                 "monitors"},
    "terminal": EVERYTHING_ABOVE_CORE - {"terminal"} | {"probes", "core"},
    "monitors": {"session", "rl", "config", "demos", "cli", "__main__", "root", "observers", "probes"},
    "rl": {"config", "demos", "cli", "__main__", "root"},
    "session": {"config", "demos", "cli", "__main__", "root"},
    "checks": EVERYTHING_ABOVE_CORE | {"probes", "core"},
}
GIN_EDGE = {"config", "demos", "cli", "__main__"}

# (importer, imported) lazy imports that may close a cycle: the importer calls into a module that imports it back,
# deliberately deferred to call time. Add one only with the reason it cannot be broken.
ALLOWED_LAZY_CYCLE_EDGES: Dict[Tuple[str, str], str] = {}

# Violations known and accepted for now, each a strict xfail below (it fails once the violation is gone, so the
# entry is deleted then). Empty: the layering holds.
KNOWN_VIOLATIONS: Dict[Tuple[str, ...], str] = {}


# ------------------------------------------------------------------------------------------------ the graph
def _module_name(path: Path) -> str:
    parts = (PACKAGE,) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def _known_module(dotted: str) -> str:
    """The longest prefix of ``dotted`` that is a module of the package."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return dotted


def _targets(importer: str, node: ast.AST) -> Iterator[str]:
    """The modules an import statement names: instrument modules (resolved) and top-level external names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield _known_module(alias.name) if alias.name.split(".")[0] == PACKAGE else alias.name.split(".")[0]
        return
    assert isinstance(node, ast.ImportFrom)
    if node.level:  # relative: resolve against the importer's package
        base = importer.split(".") if importer in PACKAGES else importer.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != PACKAGE:
        yield module.split(".")[0]
        return
    for alias in node.names:
        submodule = f"{module}.{alias.name}"
        yield submodule if submodule in MODULES else _known_module(module)


def _is_type_checking(test: ast.AST) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


@functools.cache
def imports_of(module: str) -> Tuple[Tuple[str, str, int], ...]:
    """``(imported, kind, line)`` for every import in ``module``; kind is "top" or "lazy" (type-only skipped)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: List[Tuple[str, str, int]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:  # the else branch does run
                    visit(ast.Module(body=[other], type_ignores=[]), lazy)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((target, "lazy" if lazy else "top", child.lineno) for target in _targets(module, child))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return tuple(found)


def _implicit_packages(importer: str, imported: str) -> Iterator[str]:
    """Importing ``a.b.c`` first runs ``a.b``'s ``__init__`` (the root package is always initialised first, and a
    module's own package is the one importing it, so neither counts)."""
    parts = imported.split(".")
    for end in range(2, len(parts)):
        package = ".".join(parts[:end])
        if package in PACKAGES and not importer.startswith(package + "."):
            yield package


def edges(implicit: bool = True) -> Dict[str, Dict[str, Tuple[str, int]]]:
    """importer -> {imported instrument module -> (kind, line)}; top-level wins over lazy for the same pair.

    ``implicit`` adds the packages whose ``__init__`` an import runs first (they matter for cycles; for the
    layering rules the module named in the import statement is what counts).
    """
    graph: Dict[str, Dict[str, Tuple[str, int]]] = {name: {} for name in MODULES}
    for importer in MODULES:
        for imported, kind, line in imports_of(importer):
            if imported not in MODULES:
                continue
            packages = list(_implicit_packages(importer, imported)) if implicit else []
            for target in [imported, *packages]:
                if target == importer:
                    continue
                previous = graph[importer].get(target)
                if previous is None or (previous[0] == "lazy" and kind == "top"):
                    graph[importer][target] = (kind, line)
    return graph


def _strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's algorithm, iterative; components with more than one module are cycles."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _cycle_path(members: List[str], graph: Dict[str, Set[str]]) -> List[str]:
    """One concrete cycle through the first member, for the report."""
    allowed = set(members)
    start = members[0]
    previous = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & allowed):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    return members


# ------------------------------------------------------------------------------------------------ the rules
def static_violations() -> Dict[Tuple[str, ...], str]:
    found: Dict[Tuple[str, ...], str] = {}
    graph, named = edges(), edges(implicit=False)
    for importer in sorted(MODULES):
        where = f"{MODULES[importer].relative_to(ROOT.parent)}"
        importer_layer = layer(importer)
        for imported, kind, line in imports_of(importer):
            if imported == "gin" and importer_layer not in GIN_EDGE:
                found[("gin", importer, "gin")] = (
                    f"{where}:{line}: {importer} imports gin ({kind}); only the gin edge {sorted(GIN_EDGE)} may: "
                    f"take plain arguments and register the class in the config package"
                )
        for imported, (kind, line) in sorted(named[importer].items()):
            imported_layer = layer(imported)
            if imported_layer == "demos" and importer_layer != "demos":
                found[("demos", importer, imported)] = (
                    f"{where}:{line}: {importer} imports the demo {imported} ({kind}); nothing in the library "
                    f"imports a demo: a shipped .gin config imports the demo it runs"
                )
            elif imported_layer in FORBIDDEN.get(importer_layer, ()):
                found[("layer", importer, imported)] = (
                    f"{where}:{line}: {importer} ({importer_layer}/) imports {imported} ({kind}), which is above it "
                    f"in the data flow; {importer_layer}/ may not import {sorted(FORBIDDEN[importer_layer])}"
                )
    cyclic = {
        importer: {
            imported for imported, (kind, _) in targets.items()
            if not (kind == "lazy" and (importer, imported) in ALLOWED_LAZY_CYCLE_EDGES)
        }
        for importer, targets in graph.items()
    }
    for members in _strongly_connected(cyclic):
        path = _cycle_path(members, cyclic)
        hops = "; ".join(
            f"{a} imports {b} ({graph[a][b][0]}, line {graph[a][b][1]})" for a, b in zip(path, path[1:], strict=False)
        )
        found[("cycle", ", ".join(members))] = (
            f"import cycle among {members}, e.g. {hops}; break it (move the shared piece down a layer) or, if a lazy "
            f"import must stay, list it in ALLOWED_LAZY_CYCLE_EDGES with the reason"
        )
    return found


def runtime_violations() -> Dict[Tuple[str, ...], str]:
    """What ``import instrument`` really loads (a fresh interpreter): no demo."""
    code = "import sys, instrument; print(' '.join(sorted(m for m in sys.modules if m.startswith('instrument.demos'))))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    if not loaded:
        return {}
    return {("runtime", "import instrument", "instrument.demos"): f"`import instrument` imports the demos {loaded}"}


@pytest.fixture(scope="module")
def violations() -> Dict[Tuple[str, ...], str]:
    return {**static_violations(), **runtime_violations()}


# ------------------------------------------------------------------------------------------------ tests
def test_the_parser_sees_the_package():
    graph = edges()
    assert {"instrument.core.dispatch", "instrument.logger.logger", "instrument.backends.base"} <= set(MODULES)
    assert graph["instrument.logger.logger"]["instrument.backends.base"][0] == "top"
    assert "instrument.core.observer" in graph["instrument.observers.update_norm"]
    # a type-only import is no edge: core.observer names the Logger only for annotations
    assert "instrument.logger.logger" not in graph["instrument.core.observer"]


def test_no_layering_violation_beyond_the_known_ones(violations):
    unexpected = {key: message for key, message in violations.items() if key not in KNOWN_VIOLATIONS}
    assert not unexpected, f"{len(unexpected)} layering violation(s):\n" + "\n".join(
        f"- {message}" for message in unexpected.values()
    )


@pytest.mark.parametrize("key", sorted(KNOWN_VIOLATIONS), ids=lambda key: "|".join(key))
@pytest.mark.xfail(strict=True, reason="a violation known on this branch; delete its KNOWN_VIOLATIONS entry once "
                                       "the branch that removes it is merged")
def test_known_violation_is_gone(violations, key):
    assert key not in violations, f"{violations.get(key)} ({KNOWN_VIOLATIONS[key]})"


def test_rules_catch_what_they_should():
    """The checker itself: a cycle is found, a type-only import is no edge, a lazy import is an edge."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _cycle_path(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []
    lazy = imports_of("instrument.probes.probe")
    assert ("instrument.probes.script", "lazy") in {(target, kind) for target, kind, _ in lazy}


MAX_LINES = 500


def test_no_module_over_500_lines():
    """One concept per module, a few hundred lines at most (DEVELOPERS.md)."""
    bench = {f"bench.{p.stem}": p for p in sorted((ROOT.parent / "bench").glob("*.py"))}  # the bench's too
    long = {name: n for name, path in {**MODULES, **bench}.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
