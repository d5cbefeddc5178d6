"""The unit of work handed from the data pipeline to the engine: one micro-batch.

Invariants:
- `labels` follow the Hugging Face convention: unshifted, same shape as `input_ids`, -100 where a
  token is not supervised. The engine shifts them: position t is trained to predict labels[t + 1].
- Padded batches carry `attention_mask` (1 = real token, 0 = padding; right padding). Packed batches
  carry `attention_mask=None` and `position_ids` that restart at 0 for every sample in a row, which
  Hugging Face turns into a block-diagonal mask: no attention across samples.
- In a packed row the first label of every sample is -100, so no token learns to predict the first
  token of the next, unrelated sample.
- `images` (vision-language data, else None): the image processor's per-image outputs for every
  image of the micro-batch (e.g. Qwen2.5-VL `pixel_values` [total_patches, C*T*P*P] and
  `image_grid_thw` [n_images, 3]; LLaVA `pixel_values` [n_images, 3, H, W]), concatenated along
  dim 0 in row-major order of their placeholder tokens (row 0 left to right, then row 1 ...).
  `input_ids` hold each image's tokens already expanded as the model's processor expands them
  (one id per image feature position), and those positions are never supervised (label -100).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, IGNORE_INDEX where not supervised
    attention_mask: torch.Tensor | None = None  # [B, S] int64, None for packed rows
    position_ids: torch.Tensor | None = None  # [B, S] int64, restarting per packed sample
    images: dict[str, torch.Tensor] | None = None  # per-image processor outputs, see docstring

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, seq], got shape {tuple(self.input_ids.shape)}"
            )
        for name in ("labels", "attention_mask", "position_ids"):
            t = getattr(self, name)
            if t is not None and t.shape != self.input_ids.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, input_ids {tuple(self.input_ids.shape)}"
                )

    @property
    def num_tokens(self) -> int:
        """Tokens that go through the model (padding included): what the GPU computes on."""
        return self.input_ids.numel()

    @property
    def num_images(self) -> int:
        """Images of the micro-batch (0 for text): the first dim of any per-image tensor that
        has one entry per image, `image_grid_thw` or `image_sizes` when the processor gives it."""
        if not self.images:
            return 0
        for key in ("image_grid_thw", "image_sizes", "pixel_values"):
            if key in self.images:
                return int(self.images[key].shape[0])
        return int(next(iter(self.images.values())).shape[0])

    @property
    def num_target_tokens(self) -> int:
        """Supervised positions after the shift: the loss's denominator share of this batch."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            attention_mask=move(self.attention_mask),
            position_ids=move(self.position_ids),
            images=None
            if self.images is None
            else {k: v.to(device, non_blocking=True) for k, v in self.images.items()},
        )
