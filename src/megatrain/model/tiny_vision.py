"""Tiny random configs of real Hugging Face vision-language models, for `verify --tiny`, the
tests and the VLM demo.

The language part is the tiny text config of model/tiny.py (every structural feature of the
family kept); the vision tower is shrunk to two blocks of width 32 on 16-32 pixel images, with
the family's own features (Qwen's windowed and full blocks, patch merging and M-RoPE, Qwen3-VL's
deepstack taps, Gemma 3's pooled SigLIP tokens, LLaVA's CLIP feature layer). Image-token ids are
placed inside the tiny vocabulary (its last ids), so a tokenizer of that size can address them.

Pixel inputs of the right shapes for these configs, without a processor, come from
model/multimodal.py `image_inputs` (verify and the unused-parameter probe use it too).
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from megatrain.model.tiny import tiny_config

VOCAB = 256
# the last ids of the vocabulary, in the demo processor's order (assets/demo/vlm): vision start /
# begin-of-image, vision end / end-of-image, image, video
START_ID, END_ID, IMAGE_ID, VIDEO_ID = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1

_QWEN_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
}

# family -> (text model type, vision config, token ids of the top-level config)
_FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_5_vl": (
        "qwen2_5_vl_text",
        {**_QWEN_VISION, "window_size": 16, "fullatt_block_indexes": [1]},
        {},
    ),
    "qwen2_vl": (
        "qwen2_vl_text",
        {k: v for k, v in _QWEN_VISION.items() if k not in ("out_hidden_size", "num_heads")}
        | {"embed_dim": 32, "num_heads": 2, "mlp_ratio": 2},
        {},
    ),
    "qwen3_vl": (
        "qwen3_vl_text",
        {**_QWEN_VISION, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
        {},
    ),
    "qwen3_5": ("qwen3_5_text", {**_QWEN_VISION, "num_position_embeddings": 64}, {}),
    "gemma3": (
        "gemma3_text",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 4,
        },
        {"mm_tokens_per_image": 16},
    ),
    "llava": (
        "llama",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 4,
            "projection_dim": 32,
        },
        {"image_seq_length": 16},
    ),
}

VLM_MODEL_TYPES = tuple(_FAMILIES)


def tiny_vlm_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """A small random-init config of the vision-language `model_type`. `overrides` set the
    language model's fields (`vocab_size`: the image ids stay its last four), except
    `vision_config`, a dict of the vision tower's fields (e.g. {patch_size: 14})."""
    if model_type not in _FAMILIES:
        raise ValueError(
            f"no tiny vision-language config for model type {model_type!r}; "
            f"known: {', '.join(VLM_MODEL_TYPES)}"
        )
    text_type, vision, top = _FAMILIES[model_type]
    vision = {**vision, **overrides.pop("vision_config", {})}
    overrides.setdefault("vocab_size", VOCAB)
    vocab = overrides["vocab_size"]
    start, end, image, video = vocab - 4, vocab - 3, vocab - 2, vocab - 1
    text = tiny_config(text_type, **overrides).to_dict()
    if model_type.startswith("qwen"):
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        quarter = head_dim // 8  # M-RoPE sections (temporal, height, width) of head_dim / 2
        section = [head_dim // 2 - 2 * (quarter + quarter // 2), quarter, quarter]
        section[1] += quarter // 2
        section[2] += quarter // 2
        text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": section}
        ids = {
            "image_token_id": image,
            "video_token_id": video,
            "vision_start_token_id": start,
            "vision_end_token_id": end,
        }
        out = "hidden_size" if model_type == "qwen2_vl" else "out_hidden_size"
        vision = {**vision, out: text["hidden_size"]}
        if "window_size" in vision:  # two merged patches a side, whatever the patch size
            vision["window_size"] = 2 * vision["patch_size"] * vision["spatial_merge_size"]
    elif model_type == "gemma3":
        ids = {"image_token_index": image, "boi_token_index": start, "eoi_token_index": end}
    else:
        ids = {"image_token_index": image}
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(text.get(key), int) and text[key] >= start:
            text[key] = 0
    text.pop("model_type", None)
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **ids, **top)


def demo_vlm_config() -> PretrainedConfig:
    """The tiny Qwen2.5-VL of the VLM demo (examples/vlm_demo.yaml): the vocabulary and image
    ids of the demo processor (`model.tokenizer: demo_vlm`), its 14-pixel patches."""
    return tiny_vlm_config("qwen2_5_vl", **DEMO_VLM_OVERRIDES)


# what examples/vlm_demo.yaml sets as model.config_overrides (a test checks they agree)
DEMO_VLM_OVERRIDES: dict[str, Any] = {"vocab_size": 486, "vision_config": {"patch_size": 14}}
