"""The package's import graph: no cycle between its parts, and no import against the layering.

Parts are the first name under `megatrain` (a subpackage like `engine`, or a module like
`builder`). Imports inside functions count too: a lazy import is still a dependency. The
layering (docs/architecture.md, "Code map"): commands on top, then the recipe (builder, trainer,
verify), then the components; the engine knows the store and the model but not the config or
the data, and only the builder and the recipe read the whole config.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatrain

SRC = Path(megatrain.__file__).resolve().parent

# part -> parts it must never import
FORBIDDEN: dict[str, set[str]] = {
    "engine": {"config", "data", "builder", "trainer", "commands", "cli", "checkpoint"},
    "store": {"engine", "optim", "config", "data", "builder", "trainer", "commands", "cli"},
    "optim": {"engine", "config", "data", "builder", "trainer", "commands", "cli"},
    "model": {"engine", "store", "optim", "builder", "trainer", "commands", "cli"},
    "data": {"engine", "store", "optim", "model", "builder", "trainer", "commands", "cli"},
    "resources": {"builder", "trainer", "commands", "cli", "data"},
    "config": {"builder", "trainer", "commands", "cli", "engine", "store", "optim"},
    "builder": {"trainer", "commands", "cli", "verify"},
    "trainer": {"commands", "cli"},
    "verify": {"trainer", "commands", "cli"},
    "commands": {"cli"},
}


def _part(module: str) -> str | None:
    names = module.split(".")
    return names[1] if names[0] == "megatrain" and len(names) > 1 else None


def import_graph() -> dict[str, set[str]]:
    """part -> the other parts its files import."""
    graph: dict[str, set[str]] = {}
    parts = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or p.is_dir()}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        part = rel.parts[0].removesuffix(".py")
        package = ["megatrain", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], base])
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                other = _part(target)
                if other in parts and other != part:
                    graph.setdefault(part, set()).add(other)
    return graph


def test_no_forbidden_import() -> None:
    graph = import_graph()
    wrong = sorted(
        f"{part} imports {other}"
        for part, others in graph.items()
        for other in others & FORBIDDEN.get(part, set())
    )
    assert not wrong, wrong


def test_no_cycle_between_parts() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
