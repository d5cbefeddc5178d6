"""Other trainers' key names (config/aliases.py) in the errors a newcomer gets first."""

from __future__ import annotations

import pytest

from megatrain.cli import main
from megatrain.config import SECTIONS, load_config
from megatrain.config.aliases import ALIASES
from megatrain.config.types import field_types

TINY = ["--model.model_type", "llama", "--model.tiny", "true", "--model.tokenizer", "demo"]


def test_every_alias_names_an_existing_key() -> None:
    for name, target in ALIASES.items():
        section, _, key = target.partition(".")
        assert key in field_types(SECTIONS[section]), f"{name} -> {target}"


def test_hf_save_steps_points_at_save_every_not_at_a_similar_spelling() -> None:
    with pytest.raises(ValueError) as e:
        load_config(None, [*TINY, "--training.save_steps", "10"])
    assert "unknown key training.save_steps; did you mean checkpoint.save_every?" in str(e.value)
    assert "max_steps?" not in str(e.value)


def test_an_unknown_section_on_the_command_line_gets_the_config_paragraph(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", *TINY, "--lora.r", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain train: error: unknown section 'lora'; MegaTrain trains")
    assert "no LoRA" in err and "usage:" not in err


def test_a_flat_key_is_pointed_at_its_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--learning_rate", "2e-5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        "config keys are given as --section.key VALUE: did you mean --optimizer.learning_rate?"
        in err
    )
