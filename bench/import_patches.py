"""Patch a module right after it is imported: the diagnostic harnesses' hook (bench/share_diag,
bench/step_profile), whose sitecustomize.py runs in every Python process of a run with its
folder and bench/ on PYTHONPATH.

    install({"megatrain.engine.engine": patch_engine})
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any


class _Finder(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module is imported."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(patches: dict[str, Callable[[Any], None]]) -> None:
    """Patch each named module (by its dotted name) with its function once it is imported."""
    if patches:
        sys.meta_path.insert(0, _Finder(patches))
