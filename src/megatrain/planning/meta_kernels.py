"""What the GPU runs differently from meta tensors, substituted where the plan measures a
layer on the meta device (planning/activations.py): sdpa's fused kernels (flash, cuDNN,
memory-efficient) instead of the math path meta would take, and transformers' fp32 grouped
matmul fallback (MoE experts) as memory, since the meta kernel of grouped_mm takes bf16 only."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ATTENTION_BACKWARD = tuple(
    getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}_attention_backward")
    for kernel in ("flash", "efficient", "cudnn")
)
GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)


def is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class GpuKernels(TorchFunctionMode):
    """Route attention and grouped matmuls to the kernels (and memory) the GPU would use.
    `causal_only`: whether the attention calls seen were all causal without a mask (the flash
    kernel skips the masked half), and there was one."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_calls = 0
        self.masked_calls = 0  # with a mask, or not causal: every key block visited

    @property
    def causal_only(self) -> bool:
        return self.attention_calls > 0 and self.masked_calls == 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.attention_calls += 1
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            self.masked_calls += mask is not None or not causal
            return _fused_attention(*args, **kwargs)
        grouped = (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
        if func in grouped and args[0].dtype != torch.bfloat16:
            return MetaGroupedMM.apply(args[0], args[1])
        return func(*args, **kwargs)


class MetaGroupedMM(torch.autograd.Function):
    """transformers' fp32 grouped-matmul fallback, as memory: out [tokens, N] from input
    [tokens, K] and weight [experts, K, N]; backward keeps both and returns gradients like them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x.new_empty(x.shape[0], weight.shape[2])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


def _fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """sdpa's CUDA backend choice: flash or cuDNN (half precision, no mask; grouped-query
    heads as they are, the key and value gradients too), else memory-efficient (any mask,
    but equal heads), else the math path, which materializes the scores: fp32 with
    grouped-query heads and no mask (HF passes enable_gqa only without a mask) lands there
    (H200, Qwen3 fp32, 4096 tokens: 2.7 GiB above the fused-kernel prediction, about three
    [heads, seq, seq] fp32 tensors)."""
    grouped = enable_gqa and k.shape[-3] != q.shape[-3]
    flash = attn_mask is None and q.dtype in (torch.float16, torch.bfloat16)
    if grouped and not flash:
        return F.scaled_dot_product_attention(  # the mode is off inside its handler: math
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=True,
        )
    if flash:  # grouped heads as they are; the expanded gradients: attention_workspace
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdpa does before the kernel
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            attn_mask.logical_not(), float("-inf")
        )
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]
