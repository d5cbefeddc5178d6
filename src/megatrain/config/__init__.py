"""A run's configuration: one frozen dataclass per YAML section, loaded from YAML + CLI overrides.

    cfg = load_config("examples/qwen3_8b.yaml", ["--optimizer.learning_rate", "2e-5"])
    cfg.model, cfg.data, cfg.training, cfg.optimizer, cfg.memory, cfg.logging, cfg.checkpoint,
    cfg.grpo (read by `megatrain grpo` and `megatrain estimate --grpo` only), cfg.dpo
    save_config(cfg, path)                           # load_config(path) == cfg
    load_config("llama3_full_sft.yaml")              # a LLaMA-Factory / TRL file (llamafactory.py)

Sections map one to one onto YAML mappings (`model:`, `data:`, ...); `data` is
`megatrain.data.config.DataConfig`. Overrides are argv tokens `--section.key VALUE` or
`--section.key=VALUE` (a dict field also takes `--section.key.sub VALUE`); VALUE is read as a
YAML scalar or flow collection (`true`, `3`, `2e-5`, `[0.9, 0.95]`, `null`); when that does not
fit the field's type but the field takes a string, the raw text is used (`--data.system_prompt
"Note: be brief"`). Read by the CLI, the commands, the recipes, verify, the planner,
checkpoint/output_dir.py and model/ (loading, tokenizer); never by the engine
(megatrain/layering.py).

Invariants:
- Every field has a default; every section's defaults validate except `model`, which needs
  exactly one of `name_or_path` / `model_type` (and `tokenizer` with `model_type`).
- Values are type-checked against the field annotations on load: ints widen to float fields,
  YAML lists become tuples for tuple fields, nothing else is converted.
- Every error is a ValueError (FileNotFoundError for a missing file) that names the key as
  `section.key`, the offending value and what is allowed.
- `load_config` of the file `save_config(cfg, path)` wrote gives back an equal `TrainConfig`.
"""

from megatrain.config.checkpoint import CheckpointConfig
from megatrain.config.grpo import GRPOConfig
from megatrain.config.loading import (
    CONFIG_HEADER,
    config_to_dict,
    config_yaml,
    load_config,
    parse_overrides,
    save_config,
)
from megatrain.config.memory import MemoryConfig
from megatrain.config.optimizer import LR_SCHEDULERS, OPTIMIZER_IMPLS, OptimizerConfig
from megatrain.config.sections import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    SECTIONS,
    LoggingConfig,
    ModelConfig,
    TrainConfig,
    TrainingConfig,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CONFIG_HEADER",
    "DTYPES",
    "LR_SCHEDULERS",
    "OPTIMIZER_IMPLS",
    "SECTIONS",
    "CheckpointConfig",
    "GRPOConfig",
    "LoggingConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimizerConfig",
    "TrainConfig",
    "TrainingConfig",
    "config_to_dict",
    "config_yaml",
    "load_config",
    "parse_overrides",
    "save_config",
]
