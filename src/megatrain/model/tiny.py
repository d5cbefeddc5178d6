"""Tiny random configs of real Hugging Face architectures, for `verify --tiny` and the tests.

A tiny config keeps every structural feature of its architecture (grouped-query attention,
sliding-window and full layers, linear-attention layers, MoE routing, dense-then-MoE stacks,
logit soft-capping, tied or untied embeddings) at a size that runs in milliseconds on a CPU.
Sizes are overridden only for keys the architecture's config actually has.

Invariant: a config returned here builds its model. `tiny_config` constructs the model on the
meta device (no memory, milliseconds); when that fails and some integer fields of the config are
still None (counts the architecture needs but whose class leaves unset, e.g. dots1's
`n_shared_experts`), it fills them with small values and tries again; if the model still does
not build, a ValueError names the model type, the error, the unset and the shrunk fields, and
how to set a field by hand.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Applied to every architecture that has the key. Sliding windows are smaller than the sequence
# lengths the tests use (24-32 tokens), so windowed layers really differ from full ones.
_SIZES: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "max_window_layers": 1,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "query_pre_attn_scalar": 16,
    "num_nextn_predict_layers": 0,
    "n_shared_experts": 1,
}

# Integer fields that are None by design (None means "off" or "derive it"), never filled.
_NONE_BY_DESIGN = ("sliding_window", "head_dim", "num_key_value_heads", "max_window_layers")

# Per-architecture adjustments: hybrid stacks need enough layers to hold every layer type.
_PER_TYPE: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {"num_hidden_layers": 4, "full_attention_interval": 2},
    "qwen3_5_moe_text": {"num_hidden_layers": 4, "full_attention_interval": 2},
    "qwen3_next": {"num_hidden_layers": 4, "full_attention_interval": 2},
    "gemma3_text": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    "gpt_oss": {"num_hidden_layers": 4},
    "deepseek_v3": {"num_hidden_layers": 3, "head_dim": 8, "num_key_value_heads": 4},
    "deepseek_v2": {"num_hidden_layers": 3, "head_dim": 8, "num_key_value_heads": 4},
}

# Architectures the tests prove (the list); any other decoder-only type may work too.
TESTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_5_text",
    "qwen3_next",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "mistral",
    "gemma2",
    "gemma3_text",
    "phi3",
    "glm4",
    "deepseek_v3",
    "gpt_oss",
)

# Friendly names users type for the text-only variants.
_ALIASES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text"}


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A small random-init config of `model_type` (a transformers model type name)."""
    model_type = _ALIASES.get(model_type, model_type)
    if model_type not in CONFIG_MAPPING_NAMES:
        known = ", ".join(sorted(CONFIG_MAPPING_NAMES))
        raise ValueError(f"unknown model type {model_type!r}; transformers knows: {known}")
    try:
        defaults = AutoConfig.for_model(model_type)
    except Exception as err:  # the class's own defaults do not validate
        raise _tiny_error(model_type, "its default config", err, [], {}) from err
    sizes = {**_SIZES, **_PER_TYPE.get(model_type, {}), **overrides}
    kwargs = {k: v for k, v in sizes.items() if _has_key(defaults, k)}
    if _has_key(defaults, "layer_types"):
        kwargs["layer_types"] = _tiny_layer_types(defaults, kwargs.get("num_hidden_layers", 3))
    if _has_key(defaults, "mlp_layer_types"):
        n = kwargs.get("num_hidden_layers", 3)
        kwargs["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
    vocab = kwargs.get("vocab_size", getattr(defaults, "vocab_size", None))
    for key, small_id in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        token_id = getattr(defaults, key, None)
        if isinstance(token_id, int) and isinstance(vocab, int) and token_id >= vocab:
            kwargs[key] = small_id
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except Exception as err:  # the config class's own validation of the shrunk sizes
        raise _tiny_error(model_type, "its config", err, [], kwargs) from err
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return config  # no causal LM to build: the loader's decoder-only check names the problem
    error = _build_error(config)
    unset = _unset_int_fields(config)
    if error is not None and unset:
        fill = {k: v for k, v in unset.items() if k not in overrides}
        with contextlib.suppress(Exception):  # the filled values are refused: report the first
            filled = AutoConfig.for_model(model_type, **{**kwargs, **fill})
            if _build_error(filled) is None:
                return filled
    if error is not None:
        raise _tiny_error(model_type, "its model", error, list(unset), kwargs) from error
    return config


def _tiny_error(
    model_type: str, what: str, err: Exception, unset: list[str], sizes: dict[str, Any]
) -> ValueError:
    shrunk = ", ".join(f"{k}={v}" for k, v in sizes.items() if not isinstance(v, list))
    return ValueError(
        f"the tiny config of model type {model_type!r} does not build {what} "
        f"({type(err).__name__}: {_first_line(err)}). Integer fields left None: "
        f"{', '.join(unset) or 'none'}; sizes set by the tiny builder: {shrunk or 'none'}. "
        "Set the field the error names with --set FIELD=VALUE (verify) or "
        "model.config_overrides (train), or use a real checkpoint's config"
    )


def _build_error(config: PretrainedConfig) -> Exception | None:
    """The exception constructing the model raises (on the meta device), or None if it builds."""
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except ImportError:
        raise  # a missing optional dependency: its own message says what to install
    except Exception as err:  # any crash inside the HF constructor becomes a ValueError
        return err
    return None


def _unset_int_fields(config: PretrainedConfig) -> dict[str, int]:
    """None-valued fields the config class types as integers, with a small value for each."""
    params = inspect.signature(type(config).__init__).parameters
    values = config.to_dict()
    out = {}
    for key, param in params.items():
        hint = str(param.annotation)
        if (
            values.get(key, 0) is None
            and "int" in hint
            and not any(t in hint for t in ("list", "dict", "tuple", "float", "str"))
            and not key.endswith(("_token_id", "_id"))
            and key not in _NONE_BY_DESIGN
        ):
            out[key] = _SIZES.get(key, 1)
    return out


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] if lines else repr(err)


def _has_key(config: PretrainedConfig, key: str) -> bool:
    return key in config.to_dict() or key in getattr(config, "attribute_map", {})


def _tiny_layer_types(defaults: PretrainedConfig, num_layers: int) -> list[str]:
    """Every layer type of the full-size stack, in its order of appearance, cycled."""
    kinds: list[str] = []
    for kind in defaults.layer_types or []:
        if kind not in kinds:
            kinds.append(kind)
    if not kinds:
        return ["full_attention"] * num_layers
    return [kinds[i % len(kinds)] for i in range(num_layers)]


def tiny_vlm_config(**text_overrides: Any) -> PretrainedConfig:
    """A tiny random-init Qwen2.5-VL config matching the demo processor (`model.tokenizer:
    demo_vlm`, megatrain/assets/demo/vlm): its vocabulary, its vision token ids, its image
    processor's patch 14 / merge 2 / temporal patch 2. The text model keeps M-RoPE (sections
    summing to head_dim / 2); the vision tower is 2 blocks, one of them full attention."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig

    from megatrain.package_assets import demo_vlm_dir

    tokenizer = AutoTokenizer.from_pretrained(str(demo_vlm_dir()))
    ids: dict[str, Any] = {
        key: tokenizer.convert_tokens_to_ids(token)
        for key, token in (
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
        )
    }
    head_dim = _SIZES["head_dim"]
    text = {
        **{k: _SIZES[k] for k in ("hidden_size", "intermediate_size", "num_key_value_heads")},
        "num_hidden_layers": 2,
        "num_attention_heads": _SIZES["hidden_size"] // head_dim,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],  # temporal, height, width: sums to head_dim / 2
        },
        **text_overrides,
    }
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == head_dim
    vision: dict[str, Any] = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    }
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
