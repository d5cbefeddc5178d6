"""The one table of dtype names: what a config says ("bf16", "fp32") and the torch dtype it means.

Config fields (`model.compute_dtype`, `checkpoint.export_dtype`) hold the short names; code that
needs a `torch.dtype` asks `torch_dtype(name)`. The long names ("bfloat16", "float32") are
accepted too, so a torch dtype's own name round-trips.
"""

from __future__ import annotations

import torch

DTYPE_NAMES = ("bf16", "fp32")
"""The names a config accepts for compute and export dtypes."""

_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of `name` ("bf16"/"fp32", their long names, or a torch dtype of those)."""
    if isinstance(name, torch.dtype):
        if name not in _TORCH.values():
            raise ValueError(f"dtype must be bf16 or fp32, got {name}")
        return name
    short = _ALIASES.get(name, name)
    if short not in _TORCH:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return _TORCH[short]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name ("bf16"/"fp32") of a torch dtype."""
    return next(k for k, v in _TORCH.items() if v == torch_dtype(dtype))
