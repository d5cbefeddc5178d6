"""Vision-language runs of bench/cli_train.py (`--images SHARE`): the Qwen2.5-VL presets (nested
text and vision configs, so not bench/common.py's flat PRESETS), a processor folder, and an
image data set in LLaMA-Factory's mllm format whose packed rows hold about SHARE image tokens.

The processor is the demo_vlm one (the demo tokenizer + Qwen's vision tokens 482-485, a Qwen2-VL
image processor, patch 14, merge 2) copied into the run's folder with its min/max pixels set to
the data's limits: the built-in `model.tokenizer: demo_vlm` caps images at 112 x 112 pixels
(16 tokens, its own max_pixels, whatever data.image_max_pixels says), so a 448 x 448 image
would not give its 256 tokens.

One sample a row: each sample is `per_row` images of `side` pixels plus demo text up to
seq - MARGIN tokens (through the chat template), so a packed row holds one sample and
images_per_step = rows x per_row. With `share` 0, the same rows with each image's tokens
(<|vision_start|>, its image tokens, <|vision_end|>) replaced by as many text tokens.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from pairs_data import _Text

MARGIN = 8
NAME = "vlm_rows"
# the demo_vlm tokenizer's ids (the run's processor is a copy of it)
IDS = {"image_token_id": 484, "video_token_id": 485, "vision_start_token_id": 482}
IDS["vision_end_token_id"] = 483
ENTRY_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user"}
ENTRY_TAGS["assistant_tag"] = "assistant"

VLM_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-7b": dict(
        text=dict(
            hidden_size=3584,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            intermediate_size=18944,
            vocab_size=152064,
            rope_parameters=dict(
                rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]
            ),
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
    ),
    # the CPU check's shape: a small text model, two vision blocks of width 32
    "qwen2.5-vl-tiny": dict(
        text=dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=384,
            vocab_size=486,
            rope_parameters=dict(
                rope_type="default", rope_theta=1000000.0, mrope_section=[4, 6, 6]
            ),
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
        vision=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=128,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
    ),
}


def vlm_config(name: str, layers: int | None = None) -> Any:
    """The preset's Qwen2.5-VL config (`layers`: the text model's layer count)."""
    from transformers import AutoConfig

    preset = VLM_PRESETS[name]
    text = {**preset["text"], **({"num_hidden_layers": layers} if layers else {})}
    return AutoConfig.for_model(
        "qwen2_5_vl", text_config=text, vision_config=dict(preset["vision"]), **IDS
    )


def write_processor(folder: Path, *, min_pixels: int, max_pixels: int) -> Path:
    """The demo_vlm processor copied into `folder`, its pixel limits set (see the docstring)."""
    from megatrain.package_assets import demo_vlm_dir

    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(demo_vlm_dir(), folder)
    path = folder / "preprocessor_config.json"
    cfg = json.loads(path.read_text())
    cfg |= {"min_pixels": min_pixels, "max_pixels": max_pixels}
    cfg["size"] = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    path.write_text(json.dumps(cfg, indent=2))
    return folder


def _image(rng: random.Random, side: int) -> Any:
    """Random-coloured shapes on noise."""
    from PIL import Image, ImageDraw

    noise = bytes(rng.getrandbits(8) for _ in range(side * side * 3))
    image = Image.frombytes("RGB", (side, side), noise)
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.randrange(side), rng.randrange(side)
        x1, y1 = x0 + rng.randrange(8, side // 2), y0 + rng.randrange(8, side // 2)
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    return image


def image_tokens(side: int, patch: int = 14, merge: int = 2) -> int:
    """Tokens of a side x side image (side a multiple of patch x merge)."""
    return (side // patch // merge) ** 2


def write_vlm_data(
    folder: Path,
    processor: Path,
    *,
    count: int,
    seq: int,
    share: float,
    side: int,
    text_like: bool,
    distinct: int = 8,
    seed: int = 0,
) -> tuple[dict[str, Any], int]:
    """`count` rows (see the docstring) in `folder`; the config's `data` entries that name the
    set, and the images per row (0 when `text_like`: the same rows with text in their place)."""
    from megatrain.model.tokenizer import load_tokenizer

    tok = load_tokenizer(str(processor), None, trust_remote_code=False)
    text = _Text(tok, seed)
    per_image = image_tokens(side)
    per_row = max(1, round(share * seq / per_image))
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    if not text_like:
        (folder / "images").mkdir(exist_ok=True)
        for i in range(distinct):
            path = f"images/{side}_{i}.png"
            _image(rng, side).save(folder / path)
            paths.append(path)

    def length(user: list[dict[str, Any]], answer: str) -> int:
        chat = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        return len(ids) + (per_image - 1) * sum(c["type"] == "image" for c in user)

    slot = per_image + 2  # <|vision_start|>, the image's tokens, <|vision_end|>
    rows = []
    for _ in range(count):
        question = text.of(seq // 8)
        images = [{"type": "image"}] * per_row if not text_like else []
        if text_like:
            question = text.of(per_row * slot) + " " + question
        user = [*images, {"type": "text", "text": question}]
        answer = text.of(seq - MARGIN - length(user, ""))
        while length(user, answer) > seq - MARGIN:
            answer = answer.rsplit(" ", 1)[0]
        content = "<image>" * len(images) + question
        row: dict[str, Any] = {
            "messages": [
                {"role": "user", "content": content},
                {"role": "assistant", "content": answer},
            ]
        }
        row["images"] = [rng.choice(paths) for _ in images]
        rows.append(row)
    (folder / f"{NAME}.json").write_text(json.dumps(rows))
    entry = {
        "file_name": f"{NAME}.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": ENTRY_TAGS,
    }
    (folder / "dataset_info.json").write_text(json.dumps({NAME: entry}, indent=2))
    return {"dataset": NAME, "dataset_dir": str(folder)}, 0 if text_like else per_row
