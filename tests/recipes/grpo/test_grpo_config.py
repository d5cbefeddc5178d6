"""The `grpo:` section: TRL names, overrides, derived values and the errors a user sees."""

from __future__ import annotations

import pytest

from megatrain.config import load_config, save_config

MODEL = ["--model.model_type", "llama", "--model.tiny", "true", "--model.tokenizer", "demo"]


def test_overrides_and_derived_values(tmp_path) -> None:
    cfg = load_config(
        None,
        [
            *MODEL,
            "--grpo.beta",
            "0.04",
            "--grpo.loss_type",
            "dr_grpo",
            "--grpo.scale_rewards",
            "false",
            "--grpo.reward_funcs",
            "[math_answer, rewards.py:length]",
            "--grpo.reward_weights",
            "[1, 0.5]",
        ],
    )
    g = cfg.grpo
    assert (g.beta, g.loss_type, g.reward_scaling) == (0.04, "dr_grpo", "none")
    assert g.weights == (1.0, 0.5) and g.upper_epsilon == g.epsilon == 0.2
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--grpo.loss_type", "bnpo"], "grpo.loss_type='bnpo' must be one of"),
        (["--grpo.reward_weights", "[1, 2]"], "has 2 weights but grpo.reward_funcs"),
        (["--grpo.num_generations", "1"], "grpo.num_generations=1 must be an integer >= 2"),
        (["--grpo.scale_rewards", "std"], "grpo.scale_rewards='std' must be one of"),
        (["--grpo.reward_funcs", "[]"], "grpo.reward_funcs is empty"),
        (["--grpo.format_pattern", "(unclosed"], "grpo.format_pattern='(unclosed' is not a valid"),
        (["--grpo.rollout_weights", "fp4"], "grpo.rollout_weights='fp4' must be one of"),
        (
            ["--grpo.importance_sampling_correction", "always"],
            "grpo.importance_sampling_correction='always' must be one of",
        ),
        (["--grpo.importance_sampling_cap", "0.5"], "grpo.importance_sampling_cap=0.5 must be"),
    ],
)
def test_errors_name_the_key(override: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, [*MODEL, *override])
