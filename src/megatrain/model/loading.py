"""Load a Hugging Face causal LM into host memory in fp32, through transformers' own loading path.

The loaded model is the single full copy of the weights: the host store (megatrain.store) moves
each block's parameters into its flat fp32 master and leaves meta tensors behind, so no second
copy of the model ever sits in RAM. Weight renaming and fusion (for example MoE experts fused
into 3-D tensors in transformers 5) is done by `from_pretrained`, and reversed by
`save_pretrained` at export: never re-implemented here.

Attention: the user's `attn_implementation`, else transformers' choice, except that a model with
attention sinks that transformers would run eager (no sdpa support: GPT-OSS) gets
model/sink_attention.py's sdpa path (`use_sinks`, the same rule the plan applies).

Errors: a missing folder, a folder without config.json, and a hub id that cannot be fetched
(offline, unknown repo, no access) are one paragraph each, naming the key and the fix
(megatrain.hub), instead of transformers' traceback; an unreachable hub fails at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.initialization import no_init_weights
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)
from transformers.utils import logging as hf_logging

from megatrain.errors import MissingPath
from megatrain.hub import go_offline_if_unreachable, hub_error
from megatrain.model.random_init import init_on_device
from megatrain.model.sink_attention import use_sinks
from megatrain.model.tiny import tiny_config
from megatrain.model.tiny_vision import VLM_MODEL_TYPES, tiny_vlm_config
from megatrain.yaml_values import parse_yaml_value

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_config(
    source: str | None,
    *,
    model_type: str | None = None,
    tiny: bool = False,
    trust_remote_code: bool = False,
    overrides: dict[str, Any] | None = None,
) -> PretrainedConfig:
    """The model config from a hub id, a local directory, or `model_type` (+ `tiny`)."""
    if model_type is not None:
        if source is not None:
            raise ValueError("give either model.name_or_path or model.model_type, not both")
        if tiny and model_type in VLM_MODEL_TYPES:
            config = tiny_vlm_config(model_type, **(overrides or {}))
        elif tiny:
            config = tiny_config(model_type, **(overrides or {}))
        else:
            config = AutoConfig.for_model(model_type, **(overrides or {}))
    elif source is None:
        raise ValueError(
            "no model given: set model.name_or_path (hub id or directory) "
            "or model.model_type (with model.tiny: true for a tiny random model)"
        )
    else:
        resolved = _resolve(source)
        try:
            config = AutoConfig.from_pretrained(
                resolved, trust_remote_code=trust_remote_code, **(overrides or {})
            )
        except OSError as e:
            if Path(resolved).is_dir():
                raise
            raise hub_error("model.name_or_path", source, e, what="model config") from e
    check_decoder_only(config, source or model_type or "")
    return config


def parse_config_sets(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` command-line model-config overrides; VALUE read as YAML, as
    `--model.config_overrides.KEY VALUE` reads it (`False` and `false` are booleans)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = parse_yaml_value(value)
    return out


def is_vision_language(config: PretrainedConfig) -> bool:
    """An image-text-to-text model (vision tower + projector + a decoder language model)."""
    return (
        getattr(config, "vision_config", None) is not None
        and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def model_class(config: PretrainedConfig) -> Any:
    """The auto class that builds the whole model: image-text-to-text for vision-language
    models whose multimodal body holds a `language_model` (what streams; model/structure.py),
    else the causal LM (a vision-language type built otherwise, e.g. Llama 4, trains its text
    model, as transformers' AutoModelForCausalLM loads it)."""
    if not is_vision_language(config):
        return AutoModelForCausalLM
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or _multimodal_body(config):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


_BODY_HOLDS_LANGUAGE: dict[str, bool] = {}  # model type -> its class's layout (sizes aside)


def _multimodal_body(config: PretrainedConfig) -> bool:
    """The image-text-to-text model of `config` has a body holding its language model (built
    once per model type on the meta device: no memory; the plan and the load both ask)."""
    if config.model_type not in _BODY_HOLDS_LANGUAGE:
        with torch.device("meta"), no_init_weights():
            model = AutoModelForImageTextToText.from_config(config)
        body = getattr(getattr(model, "model", None), "language_model", None)
        _BODY_HOLDS_LANGUAGE[config.model_type] = isinstance(body, nn.Module)
    return _BODY_HOLDS_LANGUAGE[config.model_type]


def check_decoder_only(config: PretrainedConfig, where: str) -> None:
    """Refuse encoder-decoder and non-causal-LM configs with the reason and the model's name."""
    if is_vision_language(config) and not getattr(config, "is_encoder_decoder", False):
        return
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{where}: model type {config.model_type!r} is an encoder-decoder model; MegaTrain "
            "trains decoder-only causal language models (AutoModelForCausalLM) only"
        )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(
        config, "auto_map", {}
    ).get("AutoModelForCausalLM"):
        raise ValueError(
            f"{where}: model type {config.model_type!r} has no AutoModelForCausalLM class in "
            f"transformers; it is not a decoder-only causal LM MegaTrain can train"
        )


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Within: transformers draws no progress bar ("Loading weights", "Writing model shards");
    restored on exit. MegaTrain prints its own line for each step instead."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_causal_lm(
    source: str | None,
    *,
    model_type: str | None = None,
    tiny: bool = False,
    random_init: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    config_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    init_device: torch.device | None = None,
    progress_bar: bool = True,
) -> PreTrainedModel:
    """An fp32 model on the CPU: pretrained weights, or random init from the config.
    `progress_bar` False: without transformers' "Loading weights" bar (logging.progress_bar).

    Random init happens when `model_type` is given, when `random_init` is set, or when a local
    directory holds a config but no weights. It runs HF's init scheme on `init_device` (a GPU:
    seconds instead of minutes for a large model; model/random_init.py), or on the CPU (None).
    `attn_implementation` None: transformers' choice, or sdpa with sinks where `use_sinks` says.
    """
    config = load_config(
        source,
        model_type=model_type,
        tiny=tiny,
        trust_remote_code=trust_remote_code,
        overrides=config_overrides,
    )
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        if hasattr(part, "use_cache"):
            part.use_cache = False
    kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if source is not None and not random_init and _has_weights(source):
        resolved = _resolve(source)
        try:
            with contextlib.nullcontext() if progress_bar else no_progress_bars():
                model = model_class(config).from_pretrained(resolved, config=config, **kwargs)
        except OSError as e:
            if Path(resolved).is_dir():
                raise
            raise hub_error("model.name_or_path", source, e, what="model weights") from e
    elif init_device is not None and init_device.type != "cpu":
        with no_init_weights():
            model = model_class(config).from_config(config, **kwargs)
        torch.manual_seed(seed)
        init_on_device(model, init_device)
    else:
        torch.manual_seed(seed)
        model = model_class(config).from_config(config, **kwargs)
    if attn_implementation is None:
        use_sinks(model)
    model.train()
    return model


def _resolve(source: str) -> str:
    """A local directory as a path; anything else is a hub id, checked for obvious path typos."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {path} has no config.json; point model.name_or_path at a "
                "folder written by save_pretrained, or use a hub id like Qwen/Qwen2.5-0.5B"
            )
        return str(path)
    if looks_like_path(source) or path.exists():
        raise MissingPath(
            f"model path {source!r} does not exist (or is not a directory); give an existing "
            "directory with config.json, or a hub id like Qwen/Qwen2.5-0.5B",
            source,
        )
    go_offline_if_unreachable()  # a hub id: fail at once, not after the hub's retries
    return source


def looks_like_path(source: str) -> bool:
    """A value meant as a local path (a hub id is `name` or `org/name`)."""
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or (os.sep != "/" and os.sep in source)
    )


def _has_weights(source: str) -> bool:
    path = Path(source).expanduser()
    if not path.is_dir():
        return True  # a hub id: from_pretrained downloads the weights
    return any((path / name).exists() for name in _WEIGHT_FILES) or any(path.glob("*.safetensors"))
