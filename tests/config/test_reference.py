"""docs/configuration.md is what the config dataclasses render: every key, with its docstring."""

from __future__ import annotations

from dataclasses import fields

from megatrain.config import SECTIONS
from megatrain.config.reference import docs_path, field_docs, render_reference


def test_checked_in_page_is_current() -> None:
    assert docs_path().read_text(encoding="utf-8") == render_reference(), (
        "docs/configuration.md is stale: run python -m megatrain.config.reference --write"
    )


def test_every_key_is_documented() -> None:
    page = render_reference()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"
            assert f"| `{f.name}` |" in page
