"""What the static decoding path (decode.py) takes from a model: which models it serves
(`static_decode_problem`: full or linear attention, no experts, a RoPE that does not rescale,
sdpa or eager attention) and the attention it runs them with (`packed_attention`, registered
with transformers as DECODE_ATTENTION and set on the model's config by `decode_attention`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import LinearAttentionLayer, StaticCache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = ("sdpa", "eager")  # models loaded with these decode with DECODE_ATTENTION
DECODE_ATTENTION = "megatrain_static_decode"  # `packed_attention`, registered with transformers
# layer types static decoding serves, and the cache layer each gets in transformers' StaticCache
STATIC_LAYERS = {"full_attention": StaticLayer, "linear_attention": LinearAttentionLayer}


def static_decode_problem(
    config: PretrainedConfig, attn_implementation: str | None = None
) -> str | None:
    """Why a model of this config cannot decode on the static path; None when it can.
    `attn_implementation`: the one the model is loaded with (None: the config's, else sdpa)."""
    text = config.get_text_config(decoder=True)
    impl = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION:
        return f"attention implementation {impl!r} (static decoding needs {' or '.join(ATTENTION)})"
    experts = ("num_experts", "num_local_experts", "n_routed_experts")
    if any(getattr(text, k, None) for k in experts):
        return "mixture-of-experts layers (their routing reads device values on the host)"
    rope = getattr(text, "rope_parameters", None) or {}
    kinds = [rope] if "rope_type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    if any("dynamic" in k.get("rope_type", "") or k.get("rope_type") == "longrope" for k in kinds):
        return "a RoPE that rescales with the sequence length (it reads positions on the host)"
    cache = StaticCache(config=config, max_cache_len=1)
    types = getattr(text, "layer_types", None) or ["full_attention"] * len(cache.layers)
    served = [STATIC_LAYERS.get(kind) for kind in types]
    if len(served) != len(cache.layers) or any(
        type(layer) is not cls for layer, cls in zip(cache.layers, served, strict=False)
    ):
        return "sliding-window layers or a recurrent state other than linear attention's"
    return None


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The static path's attention (DECODE_ATTENTION): transformers' sdpa, except that one query
    token with grouped key/value heads always runs on the key/value heads, the queries of a
    group packed together. transformers packs them only outside torch.compile; compiled, it
    repeats the whole cache for every group, every step (7x the KV reads for Qwen2.5-7B)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    n, heads, _, width = query.shape
    packed = query.reshape(n, heads // groups, groups, width)
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(n, heads, 1, width).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, packed_attention)


@contextmanager
def decode_attention(model: Any) -> Iterator[None]:
    """The model attends with DECODE_ATTENTION inside (its config is the whole model's)."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = previous
