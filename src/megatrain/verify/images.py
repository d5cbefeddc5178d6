"""verify's image rows for vision-language models: random micro-batches with images in them.

Every sample of a row gets an image at its start when it fits (one placeholder run: the family's
begin token where it has one, the image tokens, its end token), the images of a row in two sizes
(Qwen's token count follows the size), and the last row of each micro-batch keeps none, so text
rows and image rows mix. Placeholder positions never carry loss. Random text ids that collide with
the model's special image ids are moved below them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.model.multimodal import image_inputs, image_token_id
from megatrain.model.structure import vision_modules


def _sizes(config: Any) -> list[tuple[int, int]]:
    """(height, width) pixels of the two images: Qwen 4 and 6 tokens, whatever its patch."""
    vision = config.vision_config
    unit = getattr(vision, "patch_size", 1) * getattr(vision, "spatial_merge_size", 1)
    return [(2 * unit, 2 * unit), (2 * unit, 3 * unit)]


def vision_modules_of(model: nn.Module) -> list[nn.Module]:
    """The multimodal body's modules other than its language model (none for a text LM)."""
    front = getattr(model, "model", None)
    if not isinstance(front, nn.Module) or not hasattr(front, "language_model"):
        return []
    return list(vision_modules(front).values())


def _special_ids(config: Any) -> tuple[int, int | None, int | None]:
    image = image_token_id(config)
    start = getattr(config, "vision_start_token_id", None) or getattr(
        config, "boi_token_index", None
    )
    end = getattr(config, "vision_end_token_id", None) or getattr(config, "eoi_token_index", None)
    return image, start, end


def with_images(batch: Batch, config: Any, seed: int) -> Batch:
    """`batch` with images placed at the start of its samples (see the module docstring)."""
    image, start, end = _special_ids(config)
    specials = [i for i in (image, start, end, getattr(config, "video_token_id", None)) if i]
    ids, labels = batch.input_ids.clone(), batch.labels.clone()
    low = min(specials)
    text = ids >= low
    ids[text] = ids[text] % (low - 3) + 3
    labels = torch.where(labels == IGNORE_INDEX, labels, ids)
    rows, width = ids.shape
    sizes: list[tuple[int, int]] = []
    pair = _sizes(config)
    _, counts = image_inputs(config, pair)
    for r in range(rows - 1):  # the last row stays text only
        for k, s in enumerate(_sample_starts(batch, r, width)):
            run = [t for t in (start,) if t is not None] + [image] * counts[k % 2]
            run += [t for t in (end,) if t is not None]
            limit = _sample_end(batch, r, s, width)
            if s + 1 + len(run) + 2 > limit:
                continue
            ids[r, s + 1 : s + 1 + len(run)] = torch.tensor(run)
            labels[r, s + 1 : s + 1 + len(run)] = IGNORE_INDEX
            sizes.append(pair[k % 2])
    images = image_inputs(config, sizes, seed=seed)[0] if sizes else None
    return Batch(ids, labels, batch.attention_mask, batch.position_ids, images=images)


def _sample_starts(batch: Batch, row: int, width: int) -> list[int]:
    if batch.position_ids is None or batch.attention_mask is not None:
        return [0]
    return torch.nonzero(batch.position_ids[row] == 0).flatten().tolist()[:2]


def _sample_end(batch: Batch, row: int, start: int, width: int) -> int:
    if batch.attention_mask is not None:
        return int(batch.attention_mask[row].sum())
    if batch.position_ids is None:
        return width
    later = torch.nonzero(batch.position_ids[row, start + 1 :] == 0).flatten()
    return start + 1 + int(later[0]) if later.numel() else width
