"""Attention with learned sinks on flex attention (CUDA): only the key blocks the mask keeps.

model/sink_attention.py gives sdpa the sink as one more key. Under a mask (every sliding-window
layer, and padded or packed rows) sdpa then runs a masked kernel that visits every key block:
GPT-OSS-20B's 128-token windows cost as much as full rows, and the masked kernel's backward is
slow (an H200 at 4 x 2048 tokens, 64 heads: 3.49 ms forward, 9.15 ms forward + backward for a
sliding layer, where this module takes 0.29 and 1.19; a full causal layer 1.54 / 3.80 against
0.55 / 2.51; docs/performance.md run 78).

Here the keys' softmax runs alone on flex attention, block-sparse, grouped-query attention
native, and returns its log-sum-exp; the sink joins the denominator afterwards:

    out = softmax([s, sink]) [..., :-1] @ v = flex(q, k, v) * exp(lse) / (exp(lse) + exp(sink))
        = flex(q, k, v) * sigmoid(lse - sink)

(the sink's value is zero). The gradients of q, k, v and the sinks flow through flex's output
and its log-sum-exp (autograd). A query whose keys are all masked has lse = -inf: weight 0,
output 0, as the softmax over the sink alone gives it.

The mask: the layer's boolean mask [B or 1, 1, S, S] (transformers' sdpa mask: causal, sliding
window, padding, packing) is read into flex's block lists: blocks with every position kept run
without the mask, blocks with some run it (`mask_mod` reads a copy of the mask), the others are
skipped; once a mask tensor (the layers of a type share the micro-batch's mask, and the
recompute reuses it). Where transformers passed none (causal, full rows) the lists come from
arithmetic, with no [S, S] tensor. The call runs outside a compiled layer's graph, on one
static-shape compile of flex attention per call shape.

Used where `flex_ready` says: a square call (training, log-probs; not decoding with a cache) on
CUDA with torch's flex attention, a head dim of HEAD_DIMS and a boolean mask or none; and for a
call shape within the budget of compiles (`_SHAPES`; rows run at a power-of-two width, so that
padded rows of many lengths share a compile), unless torch failed to compile that shape (a
warning, once). Flex attention has no backward on the CPU; there, and for any other call,
model/sink_attention.py's sdpa path runs.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # torch before 2.9: no log-sum-exp request (AuxRequest)
    flex_attention = None  # type: ignore[assignment]

BLOCK = 128  # flex attention's block of queries and of keys
Shape = tuple[int, int, str, torch.dtype, bool]  # rows, width, mask kind, dtype, grad mode
_SHAPES: set[Shape] = set()
"""Call shapes (rows, width, mask kind, dtype, grad mode) flex attention is compiled for, one
static compile each: as many as torch's recompile limit allows less one (`_budget`; past the
limit dynamo would run flex attention eagerly, over the whole score matrix), further shapes take
the sdpa path. Counted outside the compiled layers (whose shapes stay dynamic). Widths are
`width`'s buckets: padded rows of any length up to 2048 tokens use 5 of them, each in the
forward (no grad) and the recompute."""
_FAILED: set[Shape] = set()
"""Call shapes torch failed to compile flex attention for (its forward: torch compiles the
backward at the first backward): they run the sdpa path, with one warning each."""
HEAD_DIMS = (64, 128, 256)
"""Head dims that take flex attention: torch 2.11's flex kernel failed to compile for fp32 at
head dim 16 (Triton 3.6, an H200); GPT-OSS's is 64."""


def takes_head_dim(dims: int) -> bool:
    """Whether attention sinks at this head dim run on flex attention on CUDA (torch has it and
    the dim is one of HEAD_DIMS): the rule the engine and the planner share."""
    return flex_attention is not None and dims in HEAD_DIMS


def flex_ready(query: torch.Tensor, mask: torch.Tensor | None, causal: bool, square: bool) -> bool:
    """Whether this call runs on flex attention (the module docstring)."""
    if not query.is_cuda or not square or not takes_head_dim(query.shape[-1]):
        return False
    if mask is None:
        return causal
    return mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1


@torch.compiler.disable
def flex_sink_attention(
    query_BHSE: torch.Tensor,
    key_BGKE: torch.Tensor,
    value_BGKE: torch.Tensor,
    sinks_H: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor | None:
    """Attention over the kept keys and the sink: output [B, S, H, E]; None for a call shape
    past the budget of compiles (`_SHAPES`; the caller runs the sdpa path). Outside any
    compiled layer's graph (a graph break): torch 2.11's inductor failed to lower flex attention
    inside the engine's layers, compiled with dynamic shapes, and the block mask is made once a
    mask.

    The rows run at `width(S)` positions: the padding's keys are masked (skipped blocks), its
    queries' outputs dropped (no gradient reaches them), so one compile serves every length
    of a bucket."""
    batch, heads, seq = query_BHSE.shape[:3]
    wide = width(seq)
    kind = "causal" if mask is None else ("per row" if mask.shape[0] > 1 else "shared")
    shape: Shape = (batch, wide, kind, query_BHSE.dtype, torch.is_grad_enabled())
    if shape in _FAILED:
        return None
    if shape not in _SHAPES:
        if len(_SHAPES) >= _budget():
            return None
        _SHAPES.add(shape)
    query, key, value = (
        x if wide == seq else F.pad(x, (0, 0, 0, wide - seq))
        for x in (query_BHSE, key_BGKE, value_BGKE)
    )
    try:
        out_BHWE, aux = _compiled()(
            query,
            key,
            value,
            block_mask=_cached_block_mask(mask, seq, wide, query.device),
            scale=scale,
            enable_gqa=key_BGKE.shape[1] != heads,
            return_aux=AuxRequest(lse=True),
        )
    except torch._dynamo.exc.TorchDynamoException as err:  # torch could not compile this shape
        _FAILED.add(shape)
        warnings.warn(
            f"flex attention did not compile for attention sinks at {batch} x {wide} tokens "
            f"({type(err).__name__}); this shape runs the sdpa path: {err}",
            stacklevel=2,
        )
        return None
    weight_BHS = torch.sigmoid(aux.lse[:, :, :seq] - sinks_H.float().view(1, heads, 1))
    out_BHSE = out_BHWE[:, :, :seq] * weight_BHS.unsqueeze(-1).to(out_BHWE.dtype)
    return out_BHSE.transpose(1, 2).contiguous()


def width(seq: int) -> int:
    """Positions a row of `seq` runs at on flex attention: the next power of two, a block at
    least (padding at most doubles the row; its blocks are skipped)."""
    return max(BLOCK, 1 << (seq - 1).bit_length())


def _budget() -> int:
    """Call shapes to compile: torch's recompile limit less one (8 by default; the engine's
    compiled layers raise it, engine/slots.py)."""
    return max(1, int(torch._dynamo.config.recompile_limit) - 1)


@functools.cache
def _compiled() -> Any:
    """Flex attention compiled once per process, static shapes: one compile per call shape
    (`_budget` of them at most)."""
    return torch.compile(flex_attention, dynamic=False)


_BLOCK_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # mask tensor -> its block mask


def _cached_block_mask(mask: torch.Tensor | None, seq: int, wide: int, device: torch.device) -> Any:
    """One block mask per mask tensor (the layers of one type share the micro-batch's mask, and
    the recompute reuses it) and per causal length."""
    if mask is None:
        return _causal_block_mask(seq, wide, device)
    if mask not in _BLOCK_MASKS:
        _BLOCK_MASKS[mask] = _block_mask(mask, seq, wide, device)
    return _BLOCK_MASKS[mask]


@functools.lru_cache(maxsize=8)
def _causal_block_mask(seq: int, wide: int, device: torch.device) -> Any:
    return _block_mask(None, seq, wide, device)


def _block_mask(mask: torch.Tensor | None, seq: int, wide: int, device: torch.device) -> Any:
    """flex's BlockMask of the layer's boolean mask [B or 1, 1, S, S] (None: causal) over `wide`
    positions (a multiple of BLOCK; the padding masked): blocks where every position is kept run
    without the mask, blocks with some run `mask_mod`, the rest are skipped. One head (the mask
    is every head's); a batch of 1 serves every row."""
    blocks = wide // BLOCK
    if mask is None:  # no [S, S] tensor: a long row's would not fit
        partial, full = _causal_lists(blocks, -(-seq // BLOCK), device)

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
            return q >= k

    else:
        edge = wide - seq
        # a tensor of its own, not a view: the cache must not keep the layer's mask alive
        padded = F.pad(mask[:, 0], (0, edge, 0, edge)) if edge else mask[:, 0].clone()
        rows = padded.shape[0]
        tiles = padded.view(rows, blocks, BLOCK, blocks, BLOCK)
        some = tiles.any(dim=4).any(dim=2)  # [B or 1, query blocks, key blocks]
        every = tiles.all(dim=4).all(dim=2)
        partial, full = _block_lists(some & ~every), _block_lists(every)

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
            return padded[b if rows > 1 else 0, q, k]

    return BlockMask.from_kv_blocks(
        *partial, *full, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(wide, wide)
    )


def _causal_lists(
    blocks: int, used: int, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The causal mask's block lists (as `_block_lists`, batch 1): query block i < `used` runs
    its own block under the mask and blocks 0 .. i - 1 whole; the padding's blocks run none."""
    index = torch.arange(blocks, device=device, dtype=torch.int32)
    order = index.expand(blocks, -1).contiguous()
    diagonal = order.clone()
    diagonal[:, 0] = index
    row = index < used
    ones = row.to(torch.int32)
    below = torch.where(row, index, 0)
    return (ones[None, None], diagonal[None, None]), (below[None, None], order[None, None])


def _block_lists(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, how many key blocks are chosen and their indices first: [B, 1, Q] and
    [B, 1, Q, K] int32 (one head: the mask is the same for every head)."""
    counts = chosen.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[:, None], order.to(torch.int32)[:, None]
