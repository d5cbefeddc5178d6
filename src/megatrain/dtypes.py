"""The one table of dtype names: what a config says ("bf16", "fp32") and the torch dtype it means.

Config fields (`model.compute_dtype`, `checkpoint.export_dtype`) hold the short names; code that
needs a `torch.dtype` asks `torch_dtype(name)`. The long names ("bfloat16", "float32") are
accepted too, so a torch dtype's own name round-trips. Importing this module loads no torch:
the config reads DTYPE_NAMES, and `megatrain --help` loads the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("bf16", "fp32")
"""The names a config accepts for compute and export dtypes."""

_LONG = {"bf16": "bfloat16", "fp32": "float32"}  # torch's own names of the same dtypes
_ALIASES = {long: short for short, long in _LONG.items()}


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch  # here, not at the top: see the module docstring

    return {short: getattr(torch, long) for short, long in _LONG.items()}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of `name` ("bf16"/"fp32", their long names, or a torch dtype of those)."""
    table = _torch_dtypes()
    if not isinstance(name, str):
        if name not in table.values():
            raise ValueError(f"dtype must be bf16 or fp32, got {name}")
        return name
    short = _ALIASES.get(name, name)
    if short not in table:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return table[short]


def dtype_name(dtype: torch.dtype) -> str:
    """The short name ("bf16"/"fp32") of a torch dtype."""
    return next(k for k, v in _torch_dtypes().items() if v == torch_dtype(dtype))
