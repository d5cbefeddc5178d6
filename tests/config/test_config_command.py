"""`megatrain config --list [SECTION]`: the keys of docs/configuration.md, on the CLI."""

from __future__ import annotations

import pytest

from megatrain.cli import main
from megatrain.config import SECTIONS
from megatrain.config.types import field_types


def test_list_prints_every_key_with_type_default_and_meaning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # the text wraps at the terminal's width, up to 100
    assert main(["config", "--list", "checkpoint"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("checkpoint:\n")
    assert "  checkpoint.save_every  (an integer; default 0)\n" in out
    assert "      Optimizer steps between resumable checkpoints; 0: only at the end.\n" in out
    keys = [line.split()[0] for line in out.splitlines() if line.startswith("  checkpoint.")]
    assert keys == [f"checkpoint.{k}" for k in field_types(SECTIONS["checkpoint"])]
    assert main(["config", "--list"]) == 0
    every = capsys.readouterr().out
    headers = [line for line in every.splitlines() if line.endswith(":") and not line[:1].isspace()]
    assert headers[:2] == ["model:", "data:"]
    assert sum(line.startswith("  data.") for line in every.splitlines()) == len(
        field_types(SECTIONS["data"])
    )


def test_train_help_points_at_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "megatrain config --list [SECTION]" in " ".join(capsys.readouterr().out.split())
