"""A norm's output is not kept for the backward: its consumers keep the norm's input instead.

In a decoder layer a norm's output feeds per-token modules: `input_layernorm` the attention's
projections (q/k/v, a linear attention's input projections), `post_attention_layernorm` the
MLP. Autograd would keep that output ([tokens x hidden], 4 GiB for the 8B shape at 512k
tokens) until those modules' backward, although the norm's input is kept anyway (the layer
input, or the residual stream the norm saves). With sequence tiles (engine/tiling.py), a tiled
norm records its output here (`record`); a tiled consumer called on a recorded output runs as
`_NormThenFn`: its forward maps the norm's output as before (the MLP tile by tile, a
projection whole: its output is whole anyway), but it saves the norm's input, and its
backward re-runs norm and consumer per tile and differentiates both at once. The norm's own
autograd node then has no consumer left and is freed with its output.

Exact: the gradient of a tile is the same chain (consumer, then norm) over the same tokens;
only the parameter gradients' summation order changes (tile by tile, in fp32). Where the norm's
output has other uses too, they keep it and its node (and gradients add up as usual). The
consumers wrapped besides the MLP (`attention_linears`) are `nn.Linear` children of the
layer's other children: per-token by construction; called on anything else they run as is.

Shapes: S = the tiled (second to last) dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

Run = Callable[[torch.Tensor], torch.Tensor]

_MADE_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""A tiled norm's output -> (the norm's run, its parameters, its input); gone with the output."""


def record(out: torch.Tensor, run: Run, params: Sequence[torch.Tensor], x: torch.Tensor) -> None:
    _MADE_BY[out] = (run, params, x)


def fused_call(
    run: Run,
    tiles: int,
    mid: torch.Tensor,
    params: Sequence[torch.Tensor],
    forward_tiles: int | None = None,
) -> torch.Tensor | None:
    """`run(mid)` differentiated through the norm that made `mid`, or None if no tiled norm
    made it. The forward maps `mid` in `forward_tiles` tiles (default `tiles`; 1: whole, as
    the module alone would: the same output bits), the backward in `tiles`."""
    made = _MADE_BY.get(mid)
    if made is None:
        return None
    norm, norm_params, x = made
    out: torch.Tensor = _NormThenFn.apply(
        norm, run, (forward_tiles or tiles, tiles), mid.detach(), x, *norm_params, *params
    )
    return out


def _spans(seq: int, tiles: int) -> list[slice]:
    size = math.ceil(seq / tiles)
    return [slice(s, min(s + size, seq)) for s in range(0, seq, size)]


class _NormThenFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        norm: Run,
        run: Run,
        tiles: tuple[int, int],  # forward, backward
        mid: torch.Tensor,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.norm, ctx.run, ctx.tiles = norm, run, tiles[1]
        ctx.save_for_backward(x, *params)
        out: torch.Tensor | None = None
        for span in _spans(mid.shape[-2], tiles[0]):
            part = run(mid[..., span, :].contiguous())  # rows > 1: a copy
            if out is None:  # the width is the consumer's (a projection's may differ)
                out = part.new_empty(*mid.shape[:-1], part.shape[-1])
            out[..., span, :] = part
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, *params = ctx.saved_tensors
        grad_x = torch.empty_like(x) if x.requires_grad else None
        grads = [torch.zeros_like(p, dtype=accumulator_dtype(p.dtype)) for p in params]
        for span in _spans(x.shape[-2], ctx.tiles):
            x_t = x[..., span, :].contiguous().detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out_t = ctx.run(ctx.norm(x_t))
            wanted = [x_t, *params] if grad_x is not None else params
            got = list(
                torch.autograd.grad(
                    out_t, wanted, grad_out[..., span, :].contiguous(), allow_unused=True
                )
            )
            if grad_x is not None:
                grad_x[..., span, :] = got.pop(0)
            for acc, g in zip(grads, got, strict=True):
                if g is not None:
                    acc.add_(g)
        out = [g.to(p.dtype) for g, p in zip(grads, params, strict=True)]
        return (None, None, None, None, grad_x, *out)


class LinearConsumer:
    """Replaces an `nn.Linear`'s `forward`: fused with the tiled norm that made its input
    (module docstring), else the original."""

    def __init__(self, linear: nn.Linear, tiles: Callable[[int], int]) -> None:
        self.linear = linear
        self.tiles = tiles  # tiles for a sequence length (engine/tiling.py TilePolicy.count)
        self.inner = linear.forward  # the bound original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if x is not None and torch.is_grad_enabled() and x.dim() >= 2:
            tiles = self.tiles(x.shape[-2])
            params = [p for p in self.linear.parameters() if p.requires_grad]
            out = fused_call(self.inner, tiles, x, params, 1) if tiles > 1 else None
            if out is not None:
                return out
        return self.inner(*args, **kwargs)


def attention_linears(layer: nn.Module, per_token: list[nn.Module]) -> list[nn.Linear]:
    """The `nn.Linear` children of the layer's children other than its per-token modules
    (the attention's projections, a linear attention's input projections, ...)."""
    return [
        m
        for child in layer.children()
        if all(child is not p for p in per_token)
        for m in child.children()
        if isinstance(m, nn.Linear)
    ]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Parameter gradients sum over tiles in fp32, or in the parameters' wider dtype."""
    return torch.promote_types(dtype, torch.float32)
