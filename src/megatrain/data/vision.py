"""Images of vision-language data: paths, placeholder checks, token counts and pixel tensors.

Rows name their images as LLaMA-Factory's `images` column does: a list of paths, relative to the
data set's folder (`data.dataset_dir`) or absolute, and one `<image>` placeholder in the text per
image, in order. URLs are refused (runs are offline), as are missing files and placeholder counts
that differ from the image count: each error names the data set, the row and the path or counts.

`VisionProcessor` is everything the pipeline asks of the model's Hugging Face processor, with no
per-model code:
- `image_token` / `image_token_id`: the token the chat template renders once per image slot
  (`{"type": "image"}` content) and the processor repeats once per image feature position;
- `num_tokens(path)`: how many, from the image size after the pixel limits below: the
  processor's own `_get_num_multimodal_tokens` when a full processor loads, else the image
  processor's `get_number_of_image_patches` over its `merge_size`**2 (the Qwen2-VL family's rule,
  which is what that method of their processors computes); a model test checks the count
  against the model's own forward;
- `features(paths)`: the image processor's outputs for the images, in order (one call, so
  per-image tensors are concatenated along dim 0 as `Batch.images` requires).
The pixel limits are LLaMA-Factory's `image_max_pixels` / `image_min_pixels`: an image larger
(smaller) than the limit is resized, aspect kept, before the processor sees it, for the count and
for the pixels alike, so both always agree.

Invariant: the pipeline keeps paths, never pixels (samples stay small); images are opened again
when a micro-batch is built (loader.py, on its prefetch thread).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

IMAGE_PLACEHOLDER = "<image>"
URL_PREFIXES = ("http://", "https://")


def resolve_image_paths(raw: Any, *, dataset: str, row: int, media_dir: Path) -> list[str]:
    """The row's image column as absolute paths of existing files; ValueError/FileNotFoundError
    naming the data set, the row and the path otherwise."""
    if raw is None or raw == "":
        return []
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, str) for p in items):
        raise ValueError(
            f"data set {dataset!r}, row {row}: the images column must be a list of file paths, "
            f"got {raw!r}"
        )
    paths = []
    for item in items:
        if item.startswith(URL_PREFIXES):
            raise ValueError(
                f"data set {dataset!r}, row {row}: image {item!r} is a URL. megatrain reads "
                "images from local files only, so that a run needs no network and reads the same "
                "pixels every time: download the images, put them under data.dataset_dir (or any "
                "folder) and list their paths, relative to data.dataset_dir or absolute, in the "
                "images column"
            )
        path = Path(item).expanduser()
        path = path if path.is_absolute() else media_dir / path
        if not path.is_file():
            raise FileNotFoundError(
                f"data set {dataset!r}, row {row}: image file {str(path)!r} not found (listed as "
                f"{item!r}; relative paths resolve against {str(media_dir)!r}, data.dataset_dir)"
            )
        paths.append(str(path))
    return paths


def check_placeholders(texts: Sequence[str], num_images: int, *, dataset: str, row: int) -> None:
    """One `<image>` placeholder per image, as LLaMA-Factory requires; ValueError otherwise."""
    found = sum(text.count(IMAGE_PLACEHOLDER) for text in texts)
    if found != num_images:
        raise ValueError(
            f"data set {dataset!r}, row {row}: the text holds {found} {IMAGE_PLACEHOLDER} "
            f"placeholder(s) but the row lists {num_images} image(s); put one "
            f"{IMAGE_PLACEHOLDER} in the messages where each image goes, in the images' order"
        )


def fit_pixels(width: int, height: int, *, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) scaled, aspect kept, into [min_pixels, max_pixels] (LLaMA-Factory's rule)."""
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    if width * height < min_pixels:
        scale = math.sqrt(min_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    return max(width, 1), max(height, 1)


class VisionProcessor:
    """The model's image processing, as the data pipeline needs it (see the module docstring)."""

    def __init__(
        self,
        image_processor: Any,
        *,
        image_token: str,
        image_token_id: int,
        processor: Any = None,
        min_pixels: int,
        max_pixels: int,
    ) -> None:
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.processor = processor
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self._expansion_checked = processor is None  # nothing to check against without it

    def image_size(self, path: str) -> tuple[int, int]:
        """(width, height) the processor sees: the file's size after the pixel limits (the
        header is read, not the pixels)."""
        from PIL import Image

        with Image.open(path) as image:
            width, height = image.size
        return fit_pixels(width, height, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def num_tokens(self, path: str) -> int:
        """Image tokens the model's processor expands this image into."""
        width, height = self.image_size(path)
        counter = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counter is not None:
            return int(counter(image_sizes=[[height, width]])["num_image_tokens"][0])
        patches = getattr(self.image_processor, "get_number_of_image_patches", None)
        if patches is None:
            raise ValueError(
                f"cannot count the image tokens of {type(self.image_processor).__name__} without "
                "the model's full processor (AutoProcessor); install what it needs (often "
                "torchvision) so AutoProcessor.from_pretrained loads"
            )
        merge = int(getattr(self.image_processor, "merge_size", 1) or 1)
        return int(patches(height, width, {})) // merge**2

    def check_expansion(self, path: str) -> None:
        """Once, with the full processor: its own expansion of one image slot must be
        `num_tokens(path)` consecutive image tokens, which is how the pipeline expands them;
        ValueError for a processor that expands images otherwise (e.g. with begin/end tokens of
        its own around them), which is not supported yet."""
        if self._expansion_checked:
            return
        expected = self.num_tokens(path)
        try:
            out = self.processor(text=[self.image_token], images=[self.load(path)])
            ids = [int(t) for t in out["input_ids"][0]]
        except Exception as err:  # the processor's own reason, kept in the message
            ids, reason = [], f" ({type(err).__name__}: {err})"
        else:
            reason = ""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != expected or (at and at[-1] - at[0] + 1 != expected):
            raise ValueError(
                f"{type(self.processor).__name__} expands an image into something other than "
                f"{expected} consecutive {self.image_token} tokens{reason}; megatrain expands "
                "each image slot by repeating the image token (Qwen2-VL, Qwen2.5-VL, LLaVA-style "
                "processors), other expansions are not supported yet"
            )
        self._expansion_checked = True

    def load(self, path: str) -> Any:
        """The image as the processor gets it: RGB, resized into the pixel limits."""
        from PIL import Image

        with Image.open(path) as file:
            size = fit_pixels(*file.size, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
            image = file.resize(size) if size != file.size else file
            return image.convert("RGB")

    def features(self, paths: Sequence[str]) -> dict[str, torch.Tensor]:
        """The image processor's tensors for `paths`, per-image outputs concatenated in order."""
        out = self.image_processor(images=[self.load(p) for p in paths], return_tensors="pt")
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def load_vision(
    source: str | None, tokenizer: Any, *, min_pixels: int, max_pixels: int
) -> VisionProcessor:
    """The model's processor from `source` (its folder or hub id), for data with images; one
    ValueError when the model has no image processor or image token."""
    from transformers import AutoImageProcessor, AutoProcessor

    processor, image_processor, reason = None, None, ""
    if source is not None:
        try:
            processor = AutoProcessor.from_pretrained(source)
        except (ImportError, OSError, ValueError, TypeError, AttributeError):
            processor = None  # e.g. its video processor needs torchvision: images still work
        image_processor = getattr(processor, "image_processor", None)
        if image_processor is None:
            try:
                image_processor = AutoImageProcessor.from_pretrained(source)
            except (ImportError, OSError, ValueError) as err:
                reason = f" (reading its image processor: {type(err).__name__}: {err})"
    token = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None)
    token_id = tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
    unknown = getattr(tokenizer, "unk_token_id", None)
    if image_processor is None or not isinstance(token, str) or token_id in (None, unknown):
        raise ValueError(
            f"the data set has images, but the model ({source!r}) has no image processor and "
            f"image token (no preprocessor_config.json, or no image token in its tokenizer)"
            f"{reason.splitlines()[0] if reason else ''}, so its images cannot become tokens: "
            "train a vision-language model (e.g. "
            "Qwen/Qwen2.5-VL-3B-Instruct, or model.tokenizer: demo_vlm with the tiny demo "
            "model), or remove the image data sets from data.dataset"
        )
    return VisionProcessor(
        image_processor,
        image_token=token,
        image_token_id=int(token_id),
        processor=processor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )
