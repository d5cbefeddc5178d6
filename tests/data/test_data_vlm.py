"""Vision-language data: the `images` column as LLaMA-Factory registers it (sharegpt `mllm_demo`,
alpaca), its errors (placeholder count, URL, missing file, a model without a processor), image
token expansion and masks, the drop reason for images over cutoff_len, `data --show`."""

from __future__ import annotations

import io
import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer

from data_fixtures.helpers import demo_tokenizer
from megatrain.data import DataConfig, prepare_data, run_data_command
from megatrain.data.demo_vlm import DATASET_ENTRY, draw_dots, draw_square
from megatrain.data.template import IMAGE_OVER_CUTOFF
from megatrain.data.vision import VisionProcessor, fit_pixels, load_vision
from megatrain.package_assets import demo_vlm_dir

PROCESSOR = str(demo_vlm_dir())
DEMO_VLM = demo_vlm_dir().parent / "demo_vlm.json"
MLLM_DEMO = [  # the shape of LLaMA-Factory's data/mllm_demo.json rows
    {
        "messages": [
            {"content": "<image>Which colour is the square?", "role": "user"},
            {"content": "red", "role": "assistant"},
            {"content": "And how many dots are here?<image>", "role": "user"},
            {"content": "3", "role": "assistant"},
        ],
        "images": ["mllm_demo_data/1.png", "mllm_demo_data/2.png"],
    },
    {
        "messages": [
            {"content": "<image>Who drew this?", "role": "user"},
            {"content": "A generator.", "role": "assistant"},
        ],
        "images": ["mllm_demo_data/1.png"],
    },
]
ALPACA = [
    {"instruction": "<image>Which colour is the square?", "output": "red", "images": ["1.png"]},
    {"instruction": "Add the numbers.", "input": "2 + 3", "output": "5"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(PROCESSOR)


@pytest.fixture(scope="module")
def vision(tokenizer: Any) -> VisionProcessor:
    return load_vision(PROCESSOR, tokenizer, min_pixels=32 * 32, max_pixels=768 * 768)


def _write(folder: Path, rows: list[dict[str, Any]], entry: dict[str, Any]) -> Path:
    """A data folder: mllm_demo.json, its registry entry `mllm_demo`, two generated images."""
    (folder / "mllm_demo_data").mkdir(parents=True, exist_ok=True)
    draw_square(random.Random(0), "red").save(folder / "mllm_demo_data" / "1.png")
    draw_dots(random.Random(1), 3).save(folder / "mllm_demo_data" / "2.png")
    draw_square(random.Random(2), "blue").save(folder / "1.png")
    (folder / "mllm_demo.json").write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_demo": entry}))
    return folder


def _prepare(folder: Path, tokenizer: Any, **cfg: Any) -> Any:
    config = DataConfig(dataset="mllm_demo", dataset_dir=str(folder), **cfg)
    return prepare_data(config, tokenizer, processor=PROCESSOR)


MLLM_ENTRY = {**DATASET_ENTRY, "file_name": "mllm_demo.json"}
ALPACA_ENTRY = {"file_name": "mllm_demo.json", "columns": {"images": "images"}}


def test_llamafactory_mllm_demo_rows_load(tmp_path: Path, tokenizer: Any, vision: Any) -> None:
    data = _prepare(_write(tmp_path, MLLM_DEMO, MLLM_ENTRY), tokenizer)
    assert (data.stats.rows_read, data.stats.kept, data.stats.dropped) == (2, 2, {})
    first, second = data.train
    paths = [str(tmp_path / "mllm_demo_data" / n) for n in ("1.png", "2.png")]
    assert first.images == tuple(paths) and second.images == (paths[0],)
    assert first.image_tokens == tuple(vision.num_tokens(p) for p in paths)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((first.input_ids == image_id).sum()) == sum(first.image_tokens)
    assert data.vision is not None and data.vision.image_token == "<|image_pad|>"


def test_alpaca_rows_with_an_images_column_load(tmp_path: Path, tokenizer: Any) -> None:
    data = _prepare(_write(tmp_path, ALPACA, ALPACA_ENTRY), tokenizer)
    assert data.stats.kept == 2
    with_image, text_only = data.train
    assert with_image.images == (str(tmp_path / "1.png"),) and len(with_image.image_tokens) == 1
    assert text_only.images == () and text_only.image_tokens == ()  # text rows keep working


def test_image_tokens_are_expanded_in_place_and_never_supervised(
    tmp_path: Path, tokenizer: Any
) -> None:
    folder = _write(tmp_path, MLLM_DEMO, MLLM_ENTRY)
    for train_on_prompt in (False, True):
        (sample, _) = _prepare(folder, tokenizer, train_on_prompt=train_on_prompt).train
        ids = sample.input_ids.tolist()
        image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
        end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
        runs = []  # (length) of each vision_start, image_pad x n, vision_end group
        for i, token in enumerate(ids):
            if token == start:
                j = ids.index(end, i)
                assert set(ids[i + 1 : j]) == {image_id}
                runs.append(j - i - 1)
        assert tuple(runs) == sample.image_tokens
        assert not sample.target_mask[sample.input_ids == image_id].any()
        assert sample.target_mask.any()


def test_placeholder_count_must_equal_image_count(tmp_path: Path, tokenizer: Any) -> None:
    rows = [MLLM_DEMO[1], {**MLLM_DEMO[1], "images": MLLM_DEMO[0]["images"]}]
    with pytest.raises(ValueError) as err:
        _prepare(_write(tmp_path, rows, MLLM_ENTRY), tokenizer)
    message = str(err.value)
    assert "data set 'mllm_demo', row 2: the text holds 1 <image> placeholder(s)" in message
    assert "lists 2 image(s)" in message


def test_image_urls_are_refused(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{**MLLM_DEMO[1], "images": ["https://example.com/cat.png"]}]
    with pytest.raises(ValueError) as err:
        _prepare(_write(tmp_path, rows, MLLM_ENTRY), tokenizer)
    message = str(err.value)
    assert "data set 'mllm_demo', row 1: image 'https://example.com/cat.png' is a URL" in message
    assert "local files only" in message and "download the images" in message
    assert "\n" not in message


def test_a_missing_image_file_names_data_set_row_and_path(tmp_path: Path, tokenizer: Any) -> None:
    rows = [MLLM_DEMO[1], {**MLLM_DEMO[1], "images": ["mllm_demo_data/9.png"]}]
    with pytest.raises(FileNotFoundError) as err:
        _prepare(_write(tmp_path, rows, MLLM_ENTRY), tokenizer)
    missing = tmp_path / "mllm_demo_data" / "9.png"
    assert f"data set 'mllm_demo', row 2: image file {str(missing)!r} not found" in str(err.value)


def test_a_model_without_a_processor_is_one_error(tmp_path: Path) -> None:
    text_tokenizer = demo_tokenizer()
    config = DataConfig(
        dataset="mllm_demo", dataset_dir=str(_write(tmp_path, MLLM_DEMO, MLLM_ENTRY))
    )
    for processor in (None, str(tmp_path)):  # no source; a folder without an image processor
        with pytest.raises(ValueError) as err:
            prepare_data(config, text_tokenizer, processor=processor)
        assert "the data set has images, but the model" in str(err.value)
        assert "has no image processor and image token" in str(err.value)


def test_a_row_whose_image_tokens_do_not_fit_cutoff_len_is_dropped(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    text_row = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Add the numbers. " * 8},
        ]
    }
    rows = [MLLM_DEMO[0], text_row]  # two images, 8 or more image tokens
    with caplog.at_level(logging.WARNING):
        data = _prepare(_write(tmp_path, rows, MLLM_ENTRY), tokenizer, cutoff_len=14)
    assert data.stats.dropped == {IMAGE_OVER_CUTOFF: 1}
    assert "1 rows were dropped because their image tokens do not fit data.cutoff_len=14" in (
        caplog.text
    )
    assert data.stats.kept == 1 and data.stats.truncated == 1  # the text row is cut, not dropped


def test_pixel_limits_scale_as_llamafactory() -> None:
    assert fit_pixels(2000, 1000, min_pixels=1, max_pixels=500_000) == (1000, 500)
    assert fit_pixels(10, 10, min_pixels=400, max_pixels=10**6) == (20, 20)
    with pytest.raises(ValueError, match=r"data\.image_min_pixels=10 is more than"):
        DataConfig(image_min_pixels=10, image_max_pixels=5).validate()


def test_data_show_prints_each_image_and_its_tokens(tokenizer: Any, vision: Any) -> None:
    out = io.StringIO()
    cfg = DataConfig(dataset="demo_vlm", cutoff_len=128, shuffle=False)
    run_data_command(
        cfg, tokenizer, show=4, as_json=False, seq_len=128, micro_batch_size=2, out=out,
        processor=PROCESSOR,
    )  # fmt: skip
    text = out.getvalue()
    path = str(demo_vlm_dir().parent / "demo_vlm_images" / "0000.png")
    width, height = vision.image_size(path)
    tokens = vision.num_tokens(path)
    assert f"1 image(s):\n  {path}: {width} x {height} pixels, {tokens} tokens\n" in text
    assert f"<|vision_start|><|image_pad|> x {tokens}<|vision_end|>Which colour" in text
    assert "<|image_pad|><|image_pad|>" not in text
    images = sum(len(row["images"]) for row in json.loads(DEMO_VLM.read_text()))
    assert "train: 300 samples, " in text and f"supervised tokens, {images} images\n" in text
    json_out = io.StringIO()
    run_data_command(
        cfg, tokenizer, show=1, as_json=True, seq_len=128, micro_batch_size=2, out=json_out,
        processor=PROCESSOR,
    )  # fmt: skip
    row = json.loads(json_out.getvalue().splitlines()[0])
    assert row["images"] == [{"path": path, "width": width, "height": height, "tokens": tokens}]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert np.sum(np.asarray(row["input_ids"]) == image_id) == tokens


class _FullProcessor:
    """What AutoProcessor gives with torchvision installed (not in this test environment): the
    processor's token count and its own expansion of the image token, Qwen2.5-VL's rule, with
    `split` tokens of another kind inserted in the middle of each image's run."""

    def __init__(self, vision: VisionProcessor, tokenizer: Any, split: str = "") -> None:
        self.vision, self.tokenizer, self.split = vision, tokenizer, split

    def _tokens(self, image: Any) -> int:
        grid = self.vision.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
        return int(grid[0].prod()) // 4

    def _get_num_multimodal_tokens(self, image_sizes: list[list[int]]) -> dict[str, list[int]]:
        tokens = [self._tokens(Image.new("RGB", (w, h))) for h, w in image_sizes]
        return {"num_image_tokens": tokens}

    def __call__(self, text: list[str], images: list[Any]) -> dict[str, Any]:
        n, token = self._tokens(images[0]), self.vision.image_token
        expanded = text[0].replace(token, token * (n // 2) + self.split + token * (n - n // 2))
        return {"input_ids": [self.tokenizer(expanded, add_special_tokens=False)["input_ids"]]}


def test_a_full_processor_counts_and_its_expansion_is_checked(
    vision: VisionProcessor, tokenizer: Any
) -> None:
    path = str(demo_vlm_dir().parent / "demo_vlm_images" / "0001.png")
    for split, ok in (("", True), ("<|vision_end|>", False)):
        full = VisionProcessor(
            vision.image_processor,
            image_token=vision.image_token,
            image_token_id=vision.image_token_id,
            processor=_FullProcessor(vision, tokenizer, split),
            min_pixels=vision.min_pixels,
            max_pixels=vision.max_pixels,
        )
        assert full.num_tokens(path) == vision.num_tokens(path)
        if ok:
            full.check_expansion(path)
            continue
        with pytest.raises(ValueError, match="other expansions are not supported yet"):
            full.check_expansion(path)
