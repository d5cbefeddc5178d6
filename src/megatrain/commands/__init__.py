"""The `megatrain` commands, one module each: parse, build, run, report.

A run is assembled by megatrain.recipes.builder (RunBuilder), through the recipes (train, grpo,
dpo), verify, or directly (data, export); estimate plans with its planning half,
megatrain.planning.builder (PlanBuilder), which reads only the model's config.

Each module has `register(subparsers)`, which adds its parser and sets `run` (the function
taking the parsed namespace and returning the exit status) and, for commands that accept
`--section.key VALUE` config overrides, `takes_overrides`. `megatrain.cli` only dispatches.
A module imports torch, transformers and what loads them (the builder, the recipes) inside
`run` (train, grpo, dpo, data and export after reading the config, so config errors answer at once
too): `megatrain --help` never waits for them.
"""

from megatrain.commands import config, data, dpo, estimate, export, grpo, train, verify

COMMANDS = (train, grpo, dpo, verify, estimate, data, export, config)
"""In the order `megatrain --help` lists them."""

__all__ = ["COMMANDS"]
