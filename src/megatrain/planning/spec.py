"""What the resource estimate needs to know about a model, from its config alone.

The causal LM is built with every parameter on the meta device (no memory, no init) while the
body's own buffers stay real on the CPU: rotary frequencies are needed to capture the layers'
call arguments (planning/activations.py), and they are small. Buffers inside the layers, the
embedding and the head go to meta like the parameters. The structure comes
from `megatrain.model.structure.discover`, the same code the engine uses, so the blocks counted
here are exactly the blocks the host store builds:

- embedding block: the input embedding table, V x D (the lm_head too, when tied);
- one block per decoder layer;
- head block: the final norm, plus the lm_head weight (and bias) when untied.

MoE: parameters under an `experts` module whose leading dimension is the number of routed
experts count as active in the fraction top_k / num_experts (router, shared experts, attention
and norms are always active). Active parameters drive FLOPs; total parameters drive memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from megatrain.choices import SINK_ATTENTION
from megatrain.engine.layout import BlockSizes
from megatrain.model.flex_sinks import takes_head_dim
from megatrain.model.loading import model_class
from megatrain.model.multimodal import vision_split
from megatrain.model.sink_attention import has_sinks, use_sinks
from megatrain.model.structure import ModelStructure, discover

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_ROUTED = re.compile(r"(^|\.)experts\.")


FLEX_SINKS = "flex_sinks"
"""`LayerSpec.attn_implementation` of attention sinks on flex attention (model/flex_sinks.py:
what the engine runs on CUDA at a head dim of its HEAD_DIMS; "sinks" is the sdpa path)."""


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its parameters and what its attention costs per token."""

    params: int
    active_params: int  # params a token goes through (MoE: top_k of the routed experts)
    attn_heads: int  # 0 for layers without softmax attention (linear attention)
    attn_kv_heads: int  # key-value heads (fewer than attn_heads: grouped-query attention)
    attn_qk_dim: int
    attn_v_dim: int
    window: int | None  # sliding-window size, None for full causal attention
    # the attention the layer runs: "sdpa" (fused kernels: the causal half, the window),
    # "eager" (matmuls over the whole [B, H, S, S] score matrix, then masked), "flex_sinks"
    # (model/flex_sinks.py on CUDA: the key blocks a mask keeps) or "sinks"
    # (model/sink_attention.py: fused kernels' memory; under a mask the kernel visits every
    # block of the whole [S, S + 1] square, called causal with no mask it skips the masked half:
    # LayerProfile.causal_only tells which)
    attn_implementation: str = "sdpa"


@dataclass
class ModelSpec:
    config: PretrainedConfig
    structure: ModelStructure
    compute_dtype: torch.dtype
    vocab_size: int  # rows of the input embedding table (V)
    hidden_size: int  # D
    tied: bool
    embed_params: int  # V x D
    head_params: int  # final norm + untied lm_head (Ph)
    layers: list[LayerSpec]
    # Measurements filled on demand: per-(rows, seq, layout) of planning/activations.py, and
    # derived sizes (planning/rollout.py `state_bytes_per_sequence`).
    cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_params_max(self) -> int:
        """Pl: the largest layer, the size of a GPU slot and of a gradient accumulator."""
        return max(layer.params for layer in self.layers)

    @property
    def total_params(self) -> int:
        return self.embed_params + self.head_params + sum(la.params for la in self.layers)

    @property
    def block_params(self) -> list[int]:
        """Parameters of each host store block in forward order: embedding, layers, head."""
        return [self.embed_params, *(la.params for la in self.layers), self.head_params]

    @property
    def active_params(self) -> int:
        return self.embed_params + self.head_params + sum(la.active_params for la in self.layers)

    @property
    def lm_head_params(self) -> int:
        """Weights of the output projection (the table itself when tied): its FLOPs."""
        return self.vocab_size * self.hidden_size

    def describe(self) -> str:
        moe = ""
        if self.active_params != self.total_params:
            moe = f", {_count(self.active_params)} active"
        return (
            f"{self.structure.describe()}; {_count(self.total_params)} params{moe}; "
            f"largest layer {_count(self.layer_params_max)}; vocab {self.vocab_size}, "
            f"hidden {self.hidden_size}"
        )


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def build_spec(
    config: PretrainedConfig,
    compute_dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
) -> ModelSpec:
    """Build the causal LM of `config` with meta parameters and count its blocks.

    Attention is measured as sdpa unless `attn_implementation` (or else the config) says
    eager, or the architecture has no sdpa support (Gemma 2: transformers runs it eager): flash
    kernels keep the same O(tokens) memory as sdpa's fused kernels. With no implementation
    asked for, attention sinks without sdpa support (GPT-OSS) run model/sink_attention.py's
    sdpa path, as the loader gives them (`use_sinks`). The layers record which of the two they
    run (`LayerSpec.attn_implementation`).
    """
    attn = attn_implementation or getattr(config, "_attn_implementation", None)
    with _params_on_meta():
        try:
            model = model_class(config).from_config(
                config,
                dtype=compute_dtype,
                attn_implementation="eager" if attn == "eager" else "sdpa",
            )
        except ValueError:  # "does not support ... scaled_dot_product_attention"
            model = model_class(config).from_config(
                config, dtype=compute_dtype, attn_implementation="eager"
            )
    if attn_implementation in (None, SINK_ATTENTION):
        use_sinks(model)
    structure = discover(model)
    # Only the body's own buffers (rotary tables) run for real, in the capture; the parts
    # measured on meta tensors need theirs on meta too (e.g. DeepSeek's router bias).
    for part in (structure.embed, structure.layers, structure.final_norm, structure.lm_head):
        for module in part.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to("meta")
    text = model.config.get_text_config()
    table = structure.embed.weight
    assert isinstance(table, torch.Tensor)
    vocab, hidden = table.shape
    embed_ids = {id(p) for p in structure.embed.parameters()}
    head_params = sum(
        p.numel()
        for m in (structure.final_norm, structure.lm_head)
        for p in m.parameters()
        if id(p) not in embed_ids
    )
    layer_types = getattr(text, "layer_types", None) or []
    ran = getattr(text, "_attn_implementation", None) or model.config._attn_implementation
    layers = [
        _layer_spec(layer, layer_types[i] if i < len(layer_types) else "", text, ran)
        for i, layer in enumerate(structure.layers)
    ]
    return ModelSpec(
        config=model.config,
        structure=structure,
        compute_dtype=compute_dtype,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        tied=structure.tied,
        embed_params=table.numel(),
        head_params=head_params,
        layers=layers,
    )


@contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay where they are.

    Patches `nn.Module.register_parameter` for the duration (the technique of accelerate's
    `init_empty_weights(include_buffers=False)`); not thread-safe, so only used at start-up.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _layer_spec(
    layer: nn.Module, layer_type: str, text: PretrainedConfig, attn_implementation: str
) -> LayerSpec:
    params = sum(p.numel() for p in layer.parameters())
    experts = _expert_counts(text)
    active = params
    if experts is not None:
        num_experts, top_k = experts
        routed = sum(
            p.numel()
            for n, p in layer.named_parameters()
            if _ROUTED.search(n) and "shared" not in n and p.shape[0] == num_experts
        )
        active = params - routed + routed * top_k // num_experts
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // max(heads, 1))
    qk_dim = head_dim
    if getattr(text, "qk_nope_head_dim", None) is not None:  # multi-head latent attention
        qk_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
    v_dim = getattr(text, "v_head_dim", None) or head_dim
    linear = "linear" in layer_type or "mamba" in layer_type
    # Without per-layer types, a config's sliding_window applies to every layer (Mistral).
    windowed = "sliding" in layer_type or not layer_type
    window = getattr(text, "sliding_window", None) if windowed else None
    return LayerSpec(
        params=params,
        active_params=active,
        attn_heads=0 if linear else heads,
        attn_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        attn_qk_dim=int(qk_dim),
        attn_v_dim=int(v_dim),
        window=int(window) if window else None,
        attn_implementation=_attention_kind(layer, attn_implementation, int(qk_dim)),
    )


def _attention_kind(layer: nn.Module, attn_implementation: str, head_dims: int) -> str:
    """`LayerSpec.attn_implementation`: attention sinks run flex attention on CUDA where
    model/flex_sinks.py takes the head dim, the sdpa sink key elsewhere."""
    if attn_implementation == "eager":
        return "eager"
    if attn_implementation == SINK_ATTENTION and has_sinks(layer):
        return FLEX_SINKS if takes_head_dim(head_dims) else "sinks"
    return "sdpa"


def _expert_counts(text: PretrainedConfig) -> tuple[int, int] | None:
    """(routed experts, experts per token) of an MoE config, None for a dense one."""
    top_k = getattr(text, "num_experts_per_tok", None)
    for key in _EXPERT_COUNT_KEYS:
        num = getattr(text, key, None)
        if isinstance(num, int) and num > 0 and isinstance(top_k, int) and top_k > 0:
            return num, top_k
    return None


def block_sizes(spec: ModelSpec) -> BlockSizes:
    """The spec's blocks as the engine's device layout sees them (engine/layout.py)."""
    return BlockSizes(
        tuple(la.params for la in spec.layers),
        spec.embed_params,
        spec.head_params,
        spec.tied,
        *vision_split(spec.structure),
    )
