"""Long-row attention over groups of heads: the fused backward's workspace holds one group.

A fused attention backward (cuDNN / flash through `F.scaled_dot_product_attention`) allocates,
besides its outputs, an fp32 accumulator of the query gradient for every query head and, with
grouped-query attention, the key and value gradients expanded to every query head: 32,896
bytes a token for Llama-3.1-8B (32 query / 8 key-value heads of 128), a 16 GiB block at 512k
tokens. Heads are independent, so the same attention run as n calls, each over 1/n of the
key-value heads and their query heads, gives the same outputs and gradients with 1/n of that
block. Each call is still a whole-sequence kernel (at long rows, millions of query rows):
no FLOPs are repeated and the kernel stays saturated.

`SplitHeads` is a TorchFunctionMode the engine enters around a layer's call when the layer's
per-token parts are tiled (engine/tiling.py: long rows; not where the policy keeps the row
whole). Under autograd it replaces each
`scaled_dot_product_attention` call by `_HeadGroups`, whose forward keeps one small autograd
graph per call (the kernel's own saved tensors: its inputs as views, its output and softmax
statistics) and whose backward differentiates them one call at a time, writing the gradients
into whole-length tensors. Without autograd (the forward pass, a segment recompute) nothing
changes: the forward kernel keeps no workspace. Not split: calls with dropout (a call's mask
draws would differ from the whole's), with a mask that is differentiated, or where one call
would be all heads anyway.

Exact: each output and gradient element is computed by the same kernel over the same keys;
only which launch computes it changes.

Shapes: B batch rows, H query heads, G key-value heads, S positions, E head dims.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

HEAD_TOKENS = 1 << 21
"""(query head x position) pairs one call covers at most, unless one key-value group is more:
at 512k tokens one group of 4 query heads, whose backward block is 2 GiB for the 8B shape."""


def head_calls(heads: int, kv_heads: int, seq: int) -> int:
    """Calls one attention of `heads` query and `kv_heads` key-value heads over `seq` positions
    is split into: the fewest (a divisor of `kv_heads`) whose calls cover at most
    `HEAD_TOKENS` pairs each."""
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        return 1
    want = math.ceil(heads * seq / HEAD_TOKENS)
    return next(n for n in range(1, kv_heads + 1) if kv_heads % n == 0 and n >= min(want, kv_heads))


class _HeadGroups(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        calls: int,
        options: dict[str, Any],
        query_BHSE: torch.Tensor,
        key_BGSE: torch.Tensor,
        value_BGSE: torch.Tensor,
    ) -> torch.Tensor:
        b, h, s = query_BHSE.shape[:3]
        out_BSHE = query_BHSE.new_empty(b, s, h, value_BGSE.shape[-1])
        out_BHSE = out_BSHE.transpose(1, 2)  # HF transposes it back: then no copy
        ctx.parts = []
        for q_span, kv_span in _spans(h, key_BGSE.shape[1], calls):
            q, k, v = (
                t[:, span].detach().requires_grad_(t.requires_grad)
                for t, span in ((query_BHSE, q_span), (key_BGSE, kv_span), (value_BGSE, kv_span))
            )
            inputs = [q, k, v]
            with torch.enable_grad():
                part = F.scaled_dot_product_attention(q, k, v, **_options(options, q_span, h))
            out_BHSE[:, q_span] = part.detach()
            ctx.parts.append((q_span, kv_span, inputs, part))
        ctx.save_for_backward(query_BHSE, key_BGSE, value_BGSE)
        return out_BHSE

    @staticmethod
    def backward(ctx: Any, grad_BHSE: torch.Tensor) -> tuple[Any, ...]:
        grads: list[torch.Tensor | None] = [
            torch.empty_like(t) if t.requires_grad else None for t in ctx.saved_tensors
        ]
        parts, ctx.parts = ctx.parts, None
        while parts:
            q_span, kv_span, inputs, part = parts.pop(0)  # its graph goes with it
            wanted = [t for t in inputs if t.requires_grad]
            got = iter(torch.autograd.grad(part, wanted, grad_BHSE[:, q_span]))
            for whole, t, span in zip(grads, inputs, (q_span, kv_span, kv_span), strict=True):
                if whole is not None and t.requires_grad:
                    whole[:, span] = next(got)
            del inputs, part, wanted, got
        return (None, None, *grads)


def _spans(heads: int, kv_heads: int, calls: int) -> list[tuple[slice, slice]]:
    q_size, kv_size = heads // calls, kv_heads // calls
    return [
        (slice(i * q_size, (i + 1) * q_size), slice(i * kv_size, (i + 1) * kv_size))
        for i in range(calls)
    ]


def _options(options: dict[str, Any], q_span: slice, heads: int) -> dict[str, Any]:
    """A call's keyword arguments: a per-head mask [..., H, S, S] sliced to its heads."""
    mask = options.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == heads > 1:
        return {**options, "attn_mask": mask[:, q_span]}
    return options


class SplitHeads(TorchFunctionMode):
    """Under autograd, every scaled-dot-product attention call of the block runs as
    `head_calls` calls over groups of heads (module docstring); with `tiles` (the layer's
    TilePolicy.count) only where its sequence is tiled."""

    def __init__(self, tiles: Callable[[int], int] | None = None) -> None:
        super().__init__()
        self.tiles = tiles

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            query = args[0] if args else kwargs["query"]
            tiled = self.tiles is None or self.tiles(query.shape[-2]) > 1
            split = _split(*args, **kwargs) if tiled else None
            if split is not None:
                return split
        return func(*args, **kwargs)


def _split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The split call, or None where it runs whole (module docstring)."""
    if query.dim() != 4 or dropout_p > 0 or (attn_mask is not None and attn_mask.requires_grad):
        return None
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads and not enable_gqa:
        return None
    calls = head_calls(heads, kv_heads, query.shape[2])
    if calls == 1 or not any(t.requires_grad for t in (query, key, value)):
        return None
    options = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    out: torch.Tensor = _HeadGroups.apply(calls, options, query, key, value)
    return out


class SplitHeadsLayer:
    """Replaces a decoder layer's `forward`: under autograd it runs inside `SplitHeads`."""

    def __init__(self, layer: torch.nn.Module, tiles: Callable[[int], int]) -> None:
        self.inner = layer.forward  # the bound original
        self.tiles = tiles

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        with SplitHeads(self.tiles):
            return self.inner(*args, **kwargs)
