"""The run's tokenizer: `model.tokenizer`, else the checkpoint's own (`model.name_or_path`).

"demo" names the built-in tokenizer shipped with the package (megatrain/assets/demo).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from megatrain.config import ModelConfig
from megatrain.data.assets import demo_tokenizer_dir


def load_tokenizer(model: ModelConfig) -> Any:
    source = model.tokenizer or model.name_or_path
    if source is None:
        raise ValueError(
            "model.tokenizer is required with model.model_type (a hub id, a "
            "directory, or 'demo' for the built-in demo tokenizer)"
        )
    if source == "demo":
        source = str(demo_tokenizer_dir())
    return AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
