"""The messages a newcomer meets first (issue 44): each pinned where its text matters."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WARM_START = (
    "`megatrain train --config examples/demo.yaml --training.max_steps 120 "
    "--training.output_dir outputs/grpo_warm_start`"
)


@pytest.mark.parametrize("command", [["estimate"], ["data", "--show", "1"]])
def test_grpo_demo_before_its_warm_start_names_the_warm_start_command(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # no outputs/grpo_warm_start here
    config = str(EXAMPLES / "grpo_demo.yaml")
    assert main([*command[:1], "--config", config, *command[1:]]) == 2
    err = capsys.readouterr().err
    assert "'outputs/grpo_warm_start/hf_model'" in err and len(err.splitlines()) == 1
    assert err.rstrip().endswith(f"{config}'s header makes it first: {WARM_START}")
