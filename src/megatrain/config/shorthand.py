"""Short command-line forms that build a `TrainConfig`: `verify --model-type llama --tiny`,
`estimate --model DIR --seq-len 4096`.

A short form is a set of `section.key` values applied as overrides, on top of either a YAML file
or, without one, a command's own base values. So a short form and the YAML it abbreviates give
the same config, validated the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatrain.config.loading import load_config
from megatrain.config.sections import TrainConfig


def model_values(
    model: str | None = None,
    model_type: str | None = None,
    tiny: bool = False,
    trust_remote_code: bool = False,
    config_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`section.key` values of a model named on the command line."""
    values: dict[str, Any] = {
        "model.name_or_path": model,
        "model.model_type": model_type,
        "model.tiny": tiny or None,
        "model.trust_remote_code": trust_remote_code or None,
    }
    values |= {f"model.config_overrides.{k}": v for k, v in (config_overrides or {}).items()}
    return values


def shorthand_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Mapping[str, Any]] | None = None,
    values: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> TrainConfig:
    """The config of YAML `path` (None: `base`) with `values` (`section.key` -> value; None
    skipped) and then argv `overrides` applied. `defaults` lie under both the file and
    `base`: a command's own defaults (config/sections.py PLANNED_BATCH for grpo and dpo runs).

    Without a file, a model given by `model.model_type` gets the built-in tokenizer when none
    is named: commands that take short forms feed random or no tokens.
    """
    values = {k: v for k, v in (values or {}).items() if v is not None}
    start: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (defaults or {}).items()}
    if path is None:
        for section, body in (base or {}).items():
            start.setdefault(section, {}).update(body)
        if "model.model_type" in values and "model.tokenizer" not in values:
            start.setdefault("model", {})["tokenizer"] = "demo"
    tokens: list[str] = []
    for key, value in values.items():
        tokens += [f"--{key}", json.dumps(value)]
    return load_config(path, [*tokens, *overrides], base=start)
