"""Which part of megatrain may import which, and how long a file or a function may grow.

A part is the first name under `megatrain`: a subpackage (`engine`) or a module (`cli`).
`tests/test_layout.py` checks the code against this table with `ast` alone (no import runs):
every import of one part by another must be listed here, imports inside functions and under
`TYPE_CHECKING` included, since a lazy import is still a dependency.

Direction (the team's style guide; docs/architecture.md):
`cli -> commands -> (recipes, verify) -> (planning, engine, data, checkpoint)`. The engine knows
the store and the model, never data, config, planning or a recipe; planning reads the config and
the engine's own rules (tiling, boundaries, head), never a recipe; nothing but the CLI imports a
command; `python -m megatrain` runs `megatrain.cli.main`.

Invariants: `ALLOWED` has no cycle, and its transitive closure respects `NEVER` (the rules above
written as part -> parts it must never reach, directly or through another part), so a rule
cannot be loosened by adding one edge to the table without the test saying which rule it breaks.
"""

from __future__ import annotations

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# Leaf modules every part may import; they import only each other.
BASE: frozenset[str] = frozenset(
    {
        "allocator",
        "batch",
        "choices",
        "device",
        "disk_space",
        "distributed",
        "dtypes",
        "errors",
        "files",
        "hub",
        "layering",
        "layouts",
        "metrics",
        "native",
        "package_assets",
        "run_files",
        "threads",
        "trackers",
        "yaml_values",
    }
)

_COMPONENTS = frozenset({"config", "data", "model", "store", "optim", "engine", "planning"})

# part -> the parts (besides BASE) it may import.
ALLOWED: dict[str, frozenset[str]] = {
    **{part: frozenset() for part in BASE},
    "__init__": frozenset(),
    "data": frozenset(),
    "config": frozenset({"data"}),  # data/config.py owns the `data:` section
    "model": frozenset(),
    "store": frozenset({"model"}),
    "optim": frozenset({"model", "store"}),
    "engine": frozenset({"model", "store", "optim"}),
    "planning": frozenset({"config", "model", "store", "optim", "engine"}),
    "checkpoint": frozenset({"config", "model", "store"}),
    "recipes": _COMPONENTS | {"checkpoint"},
    "verify": _COMPONENTS | {"checkpoint", "recipes"},  # a run built as training builds it
    "commands": _COMPONENTS | {"checkpoint", "recipes", "verify"},
    "cli": _COMPONENTS | {"checkpoint", "recipes", "verify", "commands"},
    "__main__": frozenset({"cli"}),
}

_ENTRY = frozenset({"commands", "cli", "__main__"})

# part -> the parts it must never reach (the style guide's dependency direction).
NEVER: dict[str, frozenset[str]] = {
    "engine": frozenset({"data", "config", "planning", "checkpoint", "recipes", "verify"}) | _ENTRY,
    "planning": frozenset({"recipes", "verify"}) | _ENTRY,
    "data": frozenset({"recipes", "verify"}) | _ENTRY,
    "checkpoint": frozenset({"recipes", "verify"}) | _ENTRY,
    "recipes": frozenset({"verify"}) | _ENTRY,
    "verify": _ENTRY,
    **{part: _ENTRY for part in BASE | {"config", "model", "store", "optim"}},
    "commands": frozenset({"cli", "__main__"}),
}
