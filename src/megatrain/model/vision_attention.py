"""Vision towers that attend within variable-length chunks (Qwen's windows and images), in one
kernel call instead of one per chunk.

Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 vision blocks pass `cu_seqlens` (the windows or
images of all patches concatenated) to their attention. With an attention implementation whose
name contains "flash", transformers hands them to it in one call; otherwise (sdpa, eager) it
loops over the chunks in Python: for 64 images of 448 x 448 pixels per step, ~29,000 small
attention calls, a quarter of a 7B model's step (docs/performance.md, run 36).

`VARLEN` is such an implementation on PyTorch's own kernels (`torch.nn.attention.varlen`,
FlashAttention's varlen forward and backward; CUDA, bf16 / fp16): nothing to install. The
engine selects it for the vision modules' device copies where it applies (`use_varlen`); other
calls it receives (no `cu_seq_lens_q`) go to transformers' sdpa unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VARLEN = "megatrain_flash_varlen"  # "flash" in the name: the vision code passes cu_seqlens


def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # PyTorch before 2.9
        return None
    return varlen_attn


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query/key/value [1, H, T, D] with `cu_seq_lens_q`: attention within each chunk, output
    [1, T, H, D] (the layout flash implementations return); anything else: sdpa."""
    cu = kwargs.get("cu_seq_lens_q")
    varlen = _varlen_attn()
    if cu is None or varlen is None or not query.is_cuda or query.shape[0] != 1:
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq", "max_length"))}
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            is_causal=is_causal,
            **kwargs,
        )
    cu = cu.to(torch.int32)
    longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = varlen(
        q,
        k,
        v,
        cu,
        cu,
        longest,
        longest,
        scale=scaling,
        window_size=(-1, 0) if is_causal else (-1, -1),
    )
    return out.unsqueeze(0), None


AttentionInterface.register(VARLEN, _attention)


def use_varlen(module: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Point `module`'s (a device copy of a vision tower) config at VARLEN where it applies:
    CUDA, half precision, PyTorch's varlen kernels, and attention that takes `cu_seqlens`."""
    config = getattr(module, "config", None)
    if config is None or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if _varlen_attn() is None or not _takes_cu_seqlens(module):
        return False
    config._attn_implementation = VARLEN
    return True


def _takes_cu_seqlens(module: nn.Module) -> bool:
    return any(
        "cu_seqlens" in inspect.signature(type(m).forward).parameters
        for m in module.modules()
        if "attention" in type(m).__name__.lower()
    )
