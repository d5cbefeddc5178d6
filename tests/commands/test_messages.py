"""The messages a newcomer meets first (issue 44): each pinned where its text matters."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.commands.done_line import done_line

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


def test_done_line_labels_each_mean_with_its_steps() -> None:
    rewards = [0.1] * 10 + [0.5] * 20 + [0.9] * 10  # steps 11-50 of a run resumed at step 10
    line = done_line(50, 10, means={"mean reward": rewards})
    assert (
        line == "done: 50 steps (resumed at step 10), mean reward 0.100 (steps 11-20) -> 0.900 "
        "(steps 41-50)"
    )
    assert done_line(3, 0, losses=[2.0, 1.5, 1.0], means={"acc": [0.5, 1.0, 1.0]}) == (
        "done: 3 steps, loss 2.0000 -> 1.0000, acc 0.833 (steps 1-3) -> 0.833 (steps 1-3)"
    )
    assert "(step 7)" in done_line(7, 6, means={"acc": [1.0]})


def test_a_resumed_grpo_run_says_where_it_resumed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatrain.recipes.grpo import recipe

    class Resumed:  # the trainer of a run resumed at step 10 that ran steps 11-20
        def __init__(self, cfg: object) -> None:
            pass

        def train(self) -> recipe.GRPOSummary:
            return recipe.GRPOSummary(20, [0.25] * 10, None, None)

        def close(self) -> None:
            pass

    monkeypatch.setattr(recipe, "GRPOTrainer", Resumed)
    assert main(["grpo", "--config", str(EXAMPLES / "grpo_demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.strip() == (
        "done: 20 steps (resumed at step 10), mean reward 0.250 (steps 11-20) -> 0.250 "
        "(steps 11-20)"
    )
