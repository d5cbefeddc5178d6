"""The code's shape, read with `ast` alone (no torch): sizes, import direction, no import cycle.

Checks src/megatrain against megatrain/layering.py: every file at most MAX_FILE_LINES lines,
every function or method at most MAX_FUNCTION_LINES (decorators left out, docstring counted),
every import of one part by another listed in ALLOWED, no cycle between parts nor between
modules, and `python -m megatrain` running the CLI. Each failure names the file, the line and
the fix.

The KNOWN_* tables below are today's offenders in files being rewritten for issue 23; each entry
must still offend (a stale entry fails too), so the lead deletes it when its rewrite lands.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

from megatrain.layering import ALLOWED, BASE, MAX_FILE_LINES, MAX_FUNCTION_LINES, NEVER

SRC = Path(__file__).resolve().parents[1] / "src" / "megatrain"  # this checkout's, not the venv's
REPO = SRC.parents[1]

# Functions over the limit, each with the issue that will split it (none today).
KNOWN_LONG_FUNCTIONS: set[tuple[str, str]] = set()
KNOWN_LONG_FILES: set[str] = set()  # issue 23: none today

# Imports against the table (part, imported part), each with the issue that removes it: none
# today (issue 23 removed the four found when the table was written).
KNOWN_IMPORTS: set[tuple[str, str]] = set()


def _sources() -> Iterator[tuple[Path, Path]]:
    for path in sorted(SRC.rglob("*.py")):
        yield path, path.relative_to(SRC)


def _part(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path, rel: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for each megatrain module the file imports, anywhere in the file (inside
    functions and under TYPE_CHECKING too: a lazy import is still a dependency); `from a.b import
    c` gives a.b and a.b.c, one of which is a module."""
    package = ["megatrain", *rel.parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(filter(None, [*package[: len(package) - node.level + 1], base]))
            yield node.lineno, base
            for alias in node.names:  # `from megatrain.data import loader`: a module too
                yield node.lineno, f"{base}.{alias.name}"


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(part, imported part) -> where: 'src/megatrain/x.py:12 imports megatrain.y.z'."""
    parts = {_part(rel) for _, rel in _sources()}
    edges: dict[tuple[str, str], list[str]] = {}
    for path, rel in _sources():
        part = _part(rel)
        for line, module in _imports(path, rel):
            names = module.split(".")
            if names[0] != "megatrain" or len(names) < 2 or names[1] not in parts:
                continue
            if names[1] != part:
                where = f"{path.relative_to(REPO)}:{line} imports {module}"
                edges.setdefault((part, names[1]), []).append(where)
    return edges


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_files_are_short() -> None:
    long = {
        str(rel): len(path.read_text(encoding="utf-8").splitlines()) for path, rel in _sources()
    }
    long = {rel: n for rel, n in long.items() if n > MAX_FILE_LINES}
    wrong = [
        f"src/megatrain/{rel}: {n} lines > {MAX_FILE_LINES}; split it by role into modules "
        "of one concern each"
        for rel, n in sorted(long.items())
        if rel not in KNOWN_LONG_FILES
    ]
    wrong += [
        f"src/megatrain/{rel} is within {MAX_FILE_LINES} lines now: "
        "delete it from KNOWN_LONG_FILES in tests/test_layout.py"
        for rel in sorted(KNOWN_LONG_FILES - set(long))
    ]
    assert not wrong, "\n".join(wrong)


def test_functions_are_short() -> None:
    long: dict[tuple[str, str], tuple[int, int]] = {}
    for path, rel in _sources():
        for name, node in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                long[(str(rel), name)] = (node.lineno, n)
    wrong = [
        f"src/megatrain/{rel}:{line} {name}: {n} lines > {MAX_FUNCTION_LINES}; move a "
        "self-contained step into a helper function named for what it does"
        for (rel, name), (line, n) in sorted(long.items())
        if (rel, name) not in KNOWN_LONG_FUNCTIONS
    ]
    wrong += [
        f"src/megatrain/{rel} {name} is within {MAX_FUNCTION_LINES} lines now (or gone): "
        "delete it from KNOWN_LONG_FUNCTIONS in tests/test_layout.py"
        for rel, name in sorted(KNOWN_LONG_FUNCTIONS - set(long))
    ]
    assert not wrong, "\n".join(wrong)


def test_every_part_is_in_the_table() -> None:
    parts = {_part(rel) for _, rel in _sources()}
    wrong = [
        f"src/megatrain/{part}: a part not in megatrain/layering.py; add it to ALLOWED with "
        "the parts it may import"
        for part in sorted(parts - set(ALLOWED))
    ]
    wrong += [
        f"megatrain/layering.py lists {part}, which is not in src/megatrain; delete it"
        for part in sorted(set(ALLOWED) - parts)
    ]
    assert not wrong, "\n".join(wrong)


def test_imports_follow_the_table() -> None:
    edges = import_edges()
    wrong: list[str] = []
    for (part, other), where in sorted(edges.items()):
        if other in BASE or other in ALLOWED.get(part, frozenset()):
            if (part, other) in KNOWN_IMPORTS:
                wrong.append(f"{part} -> {other} is allowed: delete it from KNOWN_IMPORTS")
            continue
        if (part, other) in KNOWN_IMPORTS:
            continue
        may = sorted(ALLOWED.get(part, frozenset()))
        for w in where:
            wrong.append(
                f"{w}: `{part}` may import only the base modules and {may} "
                "(megatrain/layering.py); move what it needs down into one of those, or move "
                "the importing code up to a part allowed to import it"
            )
    wrong += [
        f"{part} no longer imports {other}: delete it from KNOWN_IMPORTS in tests/test_layout.py"
        for part, other in sorted(KNOWN_IMPORTS - set(edges))
    ]
    assert not wrong, "\n".join(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_cycle_between_parts() -> None:
    edges = import_edges()
    graph: dict[str, set[str]] = {}
    for part, other in edges:
        graph.setdefault(part, set()).add(other)
    cycle = _cycle(graph)
    if cycle:
        steps = [edges[(a, b)][0] for a, b in itertools.pairwise(cycle)]
        raise AssertionError(
            "import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(steps) + "\nbreak it by "
            "moving the shared names into the lower part (or a base module)"
        )


def _module(rel: Path) -> str:
    names = ["megatrain", *rel.with_suffix("").parts]
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def module_edges() -> dict[tuple[str, str], str]:
    """(module, imported module) -> where, between megatrain's modules (a package's
    `__init__` is the package's module)."""
    modules = {_module(rel) for _, rel in _sources()}
    edges: dict[tuple[str, str], str] = {}
    for path, rel in _sources():
        me = _module(rel)
        for line, name in _imports(path, rel):
            while name and name not in modules:  # a.b.NAME -> the module a.b
                name = name.rpartition(".")[0]
            if name and name != me:
                edges.setdefault((me, name), f"{path.relative_to(REPO)}:{line} imports {name}")
    return edges


def test_no_import_cycle_between_modules() -> None:
    """Within a part too, imports go one way (issue 40 removed the last three circles, each
    dodged by an import inside a function or under TYPE_CHECKING)."""
    edges = module_edges()
    graph: dict[str, set[str]] = {}
    for module, other in edges:
        graph.setdefault(module, set()).add(other)
    cycle = _cycle(graph)
    if cycle:
        steps = [edges[(a, b)] for a, b in itertools.pairwise(cycle)]
        raise AssertionError(
            "import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(steps) + "\nbreak it by "
            "moving what both need into the lower module or a small new one (an import inside a "
            "function or under TYPE_CHECKING still counts)"
        )


def _reach(part: str) -> set[str]:
    """Every part `part` may reach through ALLOWED, directly or not."""
    seen: set[str] = set()
    todo = [part]
    while todo:
        for other in ALLOWED[todo.pop()] | BASE:
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def test_the_table_keeps_the_style_rules() -> None:
    # base modules may import each other: their own cycles show in the test above
    graph = {part: set(ALLOWED[part]) | (set() if part in BASE else set(BASE)) for part in ALLOWED}
    cycle = _cycle(graph)
    assert cycle is None, f"megatrain/layering.py ALLOWED has a cycle: {' -> '.join(cycle or [])}"
    wrong = [
        f"megatrain/layering.py lets {part} reach {sorted(_reach(part) & never)}, which NEVER "
        "forbids: take the edge that leads there out of ALLOWED"
        for part, never in sorted(NEVER.items())
        if _reach(part) & never
    ]
    assert not wrong, "\n".join(wrong)


def test_python_m_megatrain_runs_the_cli() -> None:
    tree = ast.parse((SRC / "__main__.py").read_text(encoding="utf-8"))
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    called = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert ("megatrain.cli", "main") in imported and "main" in called, (
        "src/megatrain/__main__.py must import main from megatrain.cli and call it"
    )
