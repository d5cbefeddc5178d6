"""The built-in vision-language demo: a tiny Qwen2.5-VL-style processor and an image task.

Written by `python -m megatrain.data.demo_assets` (which calls `generate`) into
`megatrain/assets/demo/`, committed and shipped as package data, so a VLM run needs no download:

    vlm/                  the demo tokenizer plus Qwen2.5-VL's vision tokens (VISION_TOKENS),
                          a chat template that renders `{"type": "image"}` content as
                          `<|vision_start|><|image_pad|><|vision_end|>`, and a Qwen2-VL image
                          processor (patch 14, merge 2) whose MIN_PIXELS / MAX_PIXELS make every
                          demo image 4 to 16 image tokens; `model.tokenizer: demo_vlm` loads it,
                          `megatrain.model.tiny_vision.demo_vlm_config()` is the matching tiny model
    demo_vlm.json         NUM_ROWS rows in LLaMA-Factory's mllm format (sharegpt `messages` of
                          role/content with `<image>` placeholders, an `images` list of paths
                          relative to the demo folder); registered as `demo_vlm`
    demo_vlm_images/      the PNGs: a coloured square on a light background ("Which colour is the
                          square?" -> "red") or dots ("How many dots?" -> "3"); some rows show two
                          pictures of dots and ask for the total; a few rows are text only

Invariants: the output is a pure function of SEED; images are IMAGE_SIDES pixels a side; the
images and the json stay well under 1 MB together.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

SEED = 4321
NUM_ROWS = 300
IMAGE_DIR = "demo_vlm_images"
DATA_FILE = "demo_vlm.json"
PROCESSOR_DIR = "vlm"
IMAGE_SIDES = tuple(range(28, 113, 14))  # 28 .. 112 pixels
PATCH_SIZE, MERGE_SIZE = 14, 2
MIN_PIXELS = 56 * 56  # >= 4 image tokens (a token is MERGE_SIZE**2 patches of 14x14)
MAX_PIXELS = 112 * 112  # <= 16 image tokens
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 50, 170),
}
BACKGROUND = (245, 245, 240)

VLM_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DATASET_ENTRY = {
    "file_name": DATA_FILE,
    "formatting": "sharegpt",
    "columns": {"messages": "messages", "images": "images"},
    "tags": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
    },
}


def draw_square(rng: random.Random, colour: str) -> Any:
    """A `colour` square somewhere on a light background, of a random IMAGE_SIDES size."""
    from PIL import Image, ImageDraw

    width, height = rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES)
    image = Image.new("RGB", (width, height), BACKGROUND)
    side = max(8, min(width, height) // 2)
    x, y = rng.randint(0, width - side), rng.randint(0, height - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    return image


def draw_dots(rng: random.Random, count: int) -> Any:
    """`count` black dots on a light background, on distinct cells of a 3x3 grid."""
    from PIL import Image, ImageDraw

    width, height = rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES)
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    r = max(2, min(width, height) // 12)
    for cell in rng.sample(range(9), count):
        cx = (cell % 3 * 2 + 1) * width // 6
        cy = (cell // 3 * 2 + 1) * height // 6
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(20, 20, 20))
    return image


def make_row(rng: random.Random, index: int, images: dict[str, Any]) -> dict[str, Any]:
    """One mllm row; the images it names are added to `images` (relative path -> PIL image)."""
    kind = rng.random()

    def add(image: Any) -> str:
        path = f"{IMAGE_DIR}/{len(images):04d}.png"
        images[path] = image
        return path

    if kind < 0.05:  # text only: an image data set may hold rows without images
        a, b = rng.randrange(10), rng.randrange(10)
        question, answer, paths = f"Add the numbers.\n{a} + {b}", str(a + b), []
    elif kind < 0.5:
        colour = rng.choice(sorted(COLOURS))
        question, answer = "<image>Which colour is the square?", colour
        paths = [add(draw_square(rng, colour))]
    elif kind < 0.85:
        count = rng.randint(1, 5)
        question, answer, paths = "<image>How many dots?", str(count), [add(draw_dots(rng, count))]
    else:
        counts = [rng.randint(1, 4), rng.randint(1, 4)]
        question = "<image><image>How many dots are there in the two pictures together?"
        answer, paths = str(sum(counts)), [add(draw_dots(rng, c)) for c in counts]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "images": paths}


def write_processor(tokenizer_dir: Path, out_dir: Path) -> None:
    """The demo tokenizer + VISION_TOKENS + VLM_TEMPLATE + a Qwen2-VL image processor config."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_TEMPLATE
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["extra_special_tokens"] = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    }
    for key in ("is_local", "local_files_only"):  # where it was saved from, not what it is
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")


def generate(out_dir: Path, tokenizer_dir: Path, seed: int = SEED) -> None:
    """Write the processor folder, the images and demo_vlm.json into `out_dir`."""
    rng = random.Random(seed)
    images: dict[str, Any] = {}
    rows = [make_row(rng, i, images) for i in range(NUM_ROWS)]
    image_dir = out_dir / IMAGE_DIR
    if image_dir.exists():
        shutil.rmtree(image_dir)
    image_dir.mkdir(parents=True)
    for path, image in images.items():
        image.save(out_dir / path, format="PNG", optimize=True)
    lines = ",\n".join(json.dumps(row) for row in rows)  # a JSON list, one row per line
    (out_dir / DATA_FILE).write_text(f"[\n{lines}\n]\n")
    write_processor(tokenizer_dir, out_dir / PROCESSOR_DIR)
