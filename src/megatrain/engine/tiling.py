"""A decoder layer's per-token parts run over sequence tiles: [tokens x intermediate] (and the
norms' fp32 copies) never exist whole.

Hugging Face decoder layers call `self.mlp(hidden)` and their norms (`self.input_layernorm(x)`,
...) on [..., S, D]: per-token functions. The engine wraps those calls (each module keeps its
class, parameters and names; only its instance `forward` is replaced) with `TiledModule`:
- without autograd (the engine's forward, a segment recompute): the tiles run one after
  another into one output;
- with autograd (a layer's recompute + backward): a custom autograd function whose forward runs
  the tiles without saving anything but the input and whose backward re-runs each tile with
  autograd and differentiates it at once (torch.utils.checkpoint per tile), summing the
  parameter gradients over tiles in fp32. The module's parameters are the function's inputs,
  so the engine's `torch.autograd.grad(out, [x, *params])` sees their gradients as usual.

Exact: a per-token function of a tile equals the same function of the whole on those tokens;
only the parameter gradients' summation order changes (tile by tile). Not tiled: layers holding
a router whose logits the engine records for the MoE aux loss (the recorded logits must be
differentiable), models with dropout (a tile's re-run in the backward would draw other masks),
calls with more than the hidden states, and modules whose output is not one
tensor of the input's shape (found on first use; that module then runs whole). Attention is
not tiled: it runs HF's kernel (sdpa: flash / cuDNN / memory-efficient, memory linear in S),
over groups of heads at long rows (engine/attention_heads.py). A tiled norm's output is not
kept for its consumers' backward: the MLP and the attention's projections keep the norm's
input and re-run it per tile (engine/norm_fusion.py).

Shapes: S = the tiled (second to last) dimension, D = hidden size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatrain.engine.attention_heads import SplitHeadsLayer
from megatrain.engine.norm_fusion import (
    LinearConsumer,
    accumulator_dtype,
    attention_linears,
    fused_call,
    record,
)
from megatrain.engine.rng import uses_randomness
from megatrain.model.router import RouterAux
from megatrain.model.structure import ModelStructure

_AUTO_TILE_TOKENS = 16384  # a tile's [T x intermediate] of an 8B model: 0.45 GiB in bf16


@dataclass(frozen=True)
class TilePolicy:
    """How many tiles a sequence of `seq` positions is cut into: a fixed count, or auto."""

    tiles: int | None
    tile_tokens: int = _AUTO_TILE_TOKENS

    def __post_init__(self) -> None:
        assert self.tiles is None or self.tiles >= 1

    @classmethod
    def from_setting(cls, tiles: int | str, compiled: bool) -> TilePolicy | None:
        """memory.mlp_tiles; "auto" with compiled layers: none (the tiles are not traced)."""
        if tiles == "auto":
            return None if compiled else cls(None)
        return cls(int(tiles))

    def count(self, seq: int) -> int:
        n = self.tiles if self.tiles is not None else math.ceil(seq / self.tile_tokens)
        return max(1, min(n, seq))

    def describe(self, seq: int) -> str:
        n = self.count(seq)
        if n == 1:
            return "MLP and norms not tiled"
        return f"MLP and norms over {n} sequence tiles of <= {math.ceil(seq / n)} tokens"


class _TiledFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        run: Callable[[torch.Tensor], torch.Tensor],
        tiles: int,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.run, ctx.tiles = run, tiles
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return _run_tiles(run, x, tiles)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, *params = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grads = [torch.zeros_like(p, dtype=accumulator_dtype(p.dtype)) for p in params]
        for span in _spans(x.shape[-2], ctx.tiles):
            x_t = x[..., span, :].contiguous().detach().requires_grad_(True)
            with torch.enable_grad():
                out_t = ctx.run(x_t)
            got = torch.autograd.grad(
                out_t, [x_t, *params], grad_out[..., span, :].contiguous(), allow_unused=True
            )
            grad_x[..., span, :] = got[0]
            for acc, g in zip(grads, got[1:], strict=True):
                if g is not None:
                    acc.add_(g)
        out = [g.to(p.dtype) for g, p in zip(grads, params, strict=True)]
        return (None, None, grad_x, *out)


def _spans(seq: int, tiles: int) -> list[slice]:
    size = math.ceil(seq / tiles)
    return [slice(s, min(s + size, seq)) for s in range(0, seq, size)]


def _run_tiles(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int
) -> torch.Tensor:
    out = torch.empty_like(x)
    for span in _spans(x.shape[-2], tiles):
        out[..., span, :] = run(x[..., span, :].contiguous())  # rows > 1: a copy
    return out


class TiledModule:
    """Replaces one per-token module's `forward`; the original runs per tile."""

    def __init__(self, mlp: nn.Module, policy: TilePolicy, norm: bool = False) -> None:
        self.mlp = mlp
        self.policy = policy
        self.norm = norm  # its output is recorded for its consumers (engine/norm_fusion.py)
        self.inner = mlp.forward  # the bound original
        self.tileable: bool | None = None  # unknown until the first tiled call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if len(args) == 1 and not kwargs else None
        if x is None or x.dim() < 2 or self.tileable is False:
            return self.inner(*args, **kwargs)
        tiles = self.policy.count(x.shape[-2])
        if tiles == 1:
            return self.inner(x)
        if self.tileable is None:
            with torch.no_grad():
                probe = self.inner(x[..., :1, :])
            self.tileable = isinstance(probe, torch.Tensor) and probe.shape == x[..., :1, :].shape
            if not self.tileable:
                return self.inner(x)
        if not torch.is_grad_enabled():
            return _run_tiles(self.inner, x, tiles)
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        fused = fused_call(self.inner, tiles, x, params)
        if fused is not None:
            return fused
        out: torch.Tensor = _TiledFn.apply(self.inner, tiles, x, *params)
        if self.norm:
            record(out, self.inner, params, x)
        return out


def per_token_modules(layer: nn.Module) -> list[nn.Module]:
    """The layer's direct children that act per token on [..., S, D]: its `mlp` and its norms
    (input_layernorm, post_attention_layernorm, Gemma's pre/post feedforward norms, ...)."""
    return [m for name, m in layer.named_children() if name == "mlp" or _is_norm(name)]


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def tileable(structure: ModelStructure) -> bool:
    """Whether the model's layers may be tiled at all: not where they draw random numbers
    (dropout, router jitter: a tile's re-run in the backward would draw other masks)."""
    return not uses_randomness(structure)


def untiled_layers(structure: ModelStructure) -> frozenset[int]:
    """Layers whose per-token parts the tiles skip: those holding a router whose logits the
    engine records for the MoE aux loss (the recorded logits must stay differentiable). The
    same rule for the engine's real layers and the planner's meta ones."""
    aux = RouterAux.for_model(structure)
    if aux is None:
        return frozenset()
    return frozenset(
        i
        for i, layer in enumerate(structure.layers)
        if any(isinstance(m, aux.router_class) for m in layer.modules())
    )


def tile_per_token(
    layers: list[nn.Module],
    policy: TilePolicy,
    skip: set[int] | None = None,
    split_heads: bool = True,
) -> int:
    """Wrap the per-token children of every layer not in `skip`, and (`split_heads`) every
    layer's attention in head groups (engine/attention_heads.py); returns how many
    per-token children."""
    wrapped = 0
    for i, layer in enumerate(layers):
        if split_heads:
            layer.forward = SplitHeadsLayer(layer, policy.count)
        if skip and i in skip:
            continue
        per_token = per_token_modules(layer)
        for name, module in layer.named_children():
            if any(module is m for m in per_token):
                module.forward = TiledModule(module, policy, norm=_is_norm(name))
                wrapped += 1
        for linear in attention_linears(layer, per_token):
            linear.forward = LinearConsumer(linear, policy.count)  # type: ignore[method-assign]
    return wrapped


@contextlib.contextmanager
def tiled_per_token(
    layers: list[nn.Module],
    policy: TilePolicy,
    split_heads: bool = True,
    skip: set[int] | None = None,
) -> Iterator[None]:
    """`tile_per_token` for the duration of the block (the estimate's meta layers are shared)."""
    tile_per_token(layers, policy, skip, split_heads=split_heads)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
            for module in layer.modules():
                if isinstance(module.__dict__.get("forward"), (TiledModule, LinearConsumer)):
                    del module.__dict__["forward"]
