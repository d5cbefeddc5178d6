"""Attention with learned sinks (GPT-OSS) on sdpa's fused kernels, without [B, H, S, S] scores.

GPT-OSS, like other models whose attention passes `s_aux` (one learned logit per query head) to
its attention function, has no sdpa path in transformers (`_supports_sdpa = False`): without a
flash-attention 3 hub kernel it trains on `eager_attention_forward`, which materialises the
[B, H, S, S] scores (64 heads x 2048^2 in bf16: 2 GiB per micro-batch of 4 rows, several of them
kept for the backward), even on its 128-token sliding-window layers.

A softmax over [scores, sink] whose sink column is then dropped is attention over one extra key
whose logit is the sink and whose value is zero. `SINK_ATTENTION` makes the sink that key of
`F.scaled_dot_product_attention` (E: the head dim, W: E + 1 padded to a multiple of 8):

- q' = [q, 1, 0 ...] and k' = [repeat_kv(k), 0, 0 ...] ([B, H, S, W]); one sink key per head,
  [0 ... 0, sink_h / scale, 0 ...], appended to k', so that q' . k_sink x scale = sink_h;
  v' = repeat_kv(v) with a zero row for the sink key. Keys are expanded to the query heads
  because the sink differs per query head. Zero padding (the fused kernels take head dims that
  are multiples of 8) changes no dot product; the output is sliced back to v's head dim.
- full rows, where transformers passes no mask for a causal layer (the full-attention layers
  of pre-training's unpadded, unpacked rows): the sink is key 0 instead, and a query row of
  zeros goes first, whose output is dropped. The call is then square, [S + 1, S + 1], and
  sdpa's `is_causal` lets query i + 1 (the layer's query i) see key 0 (the sink) and keys
  1 .. i + 1 (the layer's 0 .. i): causal attention with a sink on the flash kernel, which
  skips the masked half. Values are padded to the query width too (flash takes equal widths).
- otherwise the mask: the layer's, with a column for the sink key that every query sees.
  transformers builds it as for sdpa (its sdpa mask function is registered for
  SINK_ATTENTION): causal, sliding-window, padded and packed rows, or None where a causal
  one does (then it is built here). With a mask, CUDA runs sdpa's memory-efficient kernel:
  O(S) memory, but every key block visited (the whole [S, S + 1] square's FLOPs: no causal
  half, no window saving). A query whose keys are all masked (padding) attends to the sink
  alone: output 0, as eager's softmax gives it.
- the sinks' gradient flows through the sink key (autograd).

On CUDA a square call (training, log-probs) with a boolean mask or none runs on flex attention
instead (model/flex_sinks.py: only the key blocks the mask keeps, the sink through flex's
log-sum-exp); the sdpa path above runs on the CPU (flex attention has no backward there) and for
decoding with a cache.

Invariants: a call without `s_aux` is transformers' `sdpa_attention_forward`, unchanged;
dropout is refused (GPT-OSS trains with 0.0). `use_sinks` selects SINK_ATTENTION for a model
where transformers resolved eager for lack of sdpa and an attention module passes `s_aux`; the
loader (model/loading.py) and the plan (planning/spec.py) call it when the user chose no
attention implementation, so the engine and the plan run the same code.

Shapes: B batch rows, H query heads, G key-value heads, S query and K key positions, E head dims.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from megatrain.choices import SINK_ATTENTION
from megatrain.model.flex_sinks import flex_ready, flex_sink_attention

HEAD_DIM_MULTIPLE = 8  # the fused kernels' head-dim alignment (16 bytes of a half-precision row)


def _attention(
    module: nn.Module,
    query_BHSE: torch.Tensor,
    key_BGKE: torch.Tensor,
    value_BGKE: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: output [B, S, H, E], no weights."""
    sinks_H = kwargs.pop("s_aux", None)
    if sinks_H is None:
        return sdpa_attention_forward(
            module,
            query_BHSE,
            key_BGKE,
            value_BGKE,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            is_causal=is_causal,
            **kwargs,
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} with attention sinks: {SINK_ATTENTION} runs without "
            "dropout; set model.config_overrides.attention_dropout: 0.0, or "
            "model.attn_implementation: eager"
        )
    window = kwargs.get("sliding_window")
    # transformers leaves a sliding layer's mask out only where the window covers every key
    assert attention_mask is not None or not window or key_BGKE.shape[2] <= window
    scale = scaling if scaling is not None else query_BHSE.shape[-1] ** -0.5
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    square = query_BHSE.shape[2] == key_BGKE.shape[2]
    if flex_ready(query_BHSE, attention_mask, causal, square):  # CUDA: the kept blocks only
        out = flex_sink_attention(query_BHSE, key_BGKE, value_BGKE, sinks_H, attention_mask, scale)
        if out is not None:  # None: a call shape past flex_sinks' budget of compiles
            return out, None
    if attention_mask is None and causal and square:  # full rows: causal, no mask
        q, k, v = _with_sink_key(query_BHSE, key_BGKE, value_BGKE, sinks_H, scale, first=True)
        out_BHSW = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[:, :, 1:]
    else:
        q, k, v = _with_sink_key(query_BHSE, key_BGKE, value_BGKE, sinks_H, scale, first=False)
        mask = _with_sink_column(attention_mask, causal and query_BHSE.shape[2] > 1, q, key_BGKE)
        out_BHSW = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out_BHSW[..., : value_BGKE.shape[-1]].transpose(1, 2).contiguous(), None


def _padded(dims: int) -> int:
    return -(-dims // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def _with_sink_key(
    query_BHSE: torch.Tensor,
    key_BGKE: torch.Tensor,
    value_BGKE: torch.Tensor,
    sinks_H: torch.Tensor,
    scale: float,
    *,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q' [B, H, S, W], k' [B, H, K + 1, W] and v' [B, H, K + 1, Wv]: the sink as key K; or,
    `first`, the sink as key 0 and an added query 0 (zeros: it sees the sink alone, its output
    is dropped), q' [B, H, S + 1, W], and v' as wide as q' (the flash kernel's rule)."""
    batch, heads, _, dims = query_BHSE.shape
    width = _padded(dims + 1)
    one = query_BHSE.new_ones(*query_BHSE.shape[:-1], 1)
    zeros = query_BHSE.new_zeros(*query_BHSE.shape[:-1], width - dims - 1)
    query = torch.cat([query_BHSE, one, zeros], dim=-1)
    groups = heads // key_BGKE.shape[1]
    sink_key = (sinks_H / scale).to(query_BHSE.dtype).view(1, heads, 1, 1)
    sink_key = F.pad(sink_key, (dims, width - dims - 1)).expand(batch, -1, -1, -1)
    keys = F.pad(repeat_kv(key_BGKE, groups), (0, width - dims))
    value_dims = value_BGKE.shape[-1]
    value_width = width if first else _padded(value_dims)
    # the sink's value row: zeros, before (first) or after the keys' values
    sink_row = (1, 0) if first else (0, 1)
    value = F.pad(repeat_kv(value_BGKE, groups), (0, value_width - value_dims, *sink_row))
    if first:
        return F.pad(query, (0, 0, 1, 0)), torch.cat([sink_key, keys], dim=2), value
    return query, torch.cat([keys, sink_key], dim=2), value


def _with_sink_column(
    mask: torch.Tensor | None, causal: bool, query: torch.Tensor, key_BGKE: torch.Tensor
) -> torch.Tensor | None:
    """The layer's mask [B or 1, 1 or H, S, K] (bool, or additive float) with a last column
    that sees the sink; None without a mask for a non-causal call (every key is seen)."""
    if mask is None:
        if not causal:
            return None
        seq, keys = query.shape[2], key_BGKE.shape[2]
        # sdpa's is_causal: the upper-left triangle (transformers skips the mask only for
        # square calls, or to cut a static cache's unused tail)
        mask = torch.ones(seq, keys, dtype=torch.bool, device=query.device).tril()[None, None]
    seen = True if mask.dtype == torch.bool else 0.0
    column = torch.full((*mask.shape[:-1], 1), seen, dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, column], dim=-1)


AttentionInterface.register(SINK_ATTENTION, _attention)
# transformers builds no mask for an implementation without a mask function (None: attend to
# every key): the one it builds for sdpa
AttentionMaskInterface.register(SINK_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_sinks(model: nn.Module) -> bool:
    """Point the configs of `model`'s attention modules that pass `s_aux` at SINK_ATTENTION
    where transformers resolved eager because the model has no sdpa support; whether any was.
    For a model loaded with no attention implementation asked for (the user's choice stands)."""
    if getattr(model, "_supports_sdpa", False):
        return False
    configs: dict[int, Any] = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and _passes_s_aux(type(m).forward):
            configs[id(config)] = config
    switched = [c for c in configs.values() if c._attn_implementation == "eager"]
    for config in switched:
        config._attn_implementation = SINK_ATTENTION
    return bool(switched)


def has_sinks(module: nn.Module) -> bool:
    """Whether `module` (a decoder layer) holds attention that passes `s_aux`."""
    return any(_passes_s_aux(type(m).forward) for m in module.modules())


@functools.cache
def _passes_s_aux(forward: Callable[..., Any]) -> bool:
    """Whether a module's forward hands `s_aux` (attention sinks) to its attention function:
    transformers' keyword for them (its flash and flex integrations take it)."""
    try:
        source = inspect.getsource(forward)  # follows functools.wraps decorators
    except (OSError, TypeError):  # no source file (a class built at run time)
        return False
    return "s_aux=" in source
