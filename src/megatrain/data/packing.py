"""Packing and padding: Samples to `megatrain.batch.Batch` rows.

Packing plan (`pack_rows`): best-fit decreasing. Samples are taken longest first (ties by index)
and each goes into the open row with the least room that still fits it, else a new row. It is a
pure function of the sample lengths and `seq_len`, so the number of rows per epoch is fixed (the
LR schedule can count steps) and the loader only shuffles whole rows between epochs; what a
sample is packed with does not change its gradient, since attention never crosses samples.

Packed rows (`packed_batch`), the Batch contract for `attention_mask=None`:
- every row is exactly `seq_len` tokens; no sample is split across rows;
- position_ids restart at 0 for each sample; labels are the sample's, except that the first
  label of each sample is IGNORE_INDEX (nothing learns to predict a new sample's first token);
- the tail is padding (pad id, label IGNORE_INDEX) with position ids 0, 1, 2, ... of its own:
  Hugging Face's `find_packed_sequence_indices` starts a new segment wherever the position id does
  not grow by exactly 1, so the tail is a separate segment that neither attends to nor is attended
  by a real sample.

Padded batches (`padded_batch`): right padding to the longest sample (rounded up to a multiple of
`pad_to_multiple_of`, capped at `max_len`), attention_mask 1/0, labels IGNORE_INDEX at pads,
position_ids = arange for every row.

Images (vision-language samples): `features` (the processor's `VisionProcessor.features`) is
called once per micro-batch on the image paths of its samples in row-major order (row 0's samples
left to right, then row 1 ...), which is the order of their image tokens in `input_ids`; its
tensors become `Batch.images`. Text-only micro-batches carry `images=None`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable

import numpy as np
import torch

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.data.sample import Sample

ImageFeatures = Callable[[list[str]], dict[str, torch.Tensor]]
"""Image paths -> the image processor's tensors for them, per-image outputs concatenated."""


def _images(
    samples: list[Sample], features: ImageFeatures | None
) -> dict[str, torch.Tensor] | None:
    """`Batch.images` of samples laid out in this order, or None when they hold no image."""
    paths = [path for sample in samples for path in sample.images]
    if not paths:
        return None
    assert features is not None, "samples with images need the processor's features"
    return features(paths)


def pack_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: indices into `lengths`, grouped into rows of at most `seq_len`."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted; full rows leave the list
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        if n > seq_len:
            raise ValueError(
                f"a sample of {n} tokens does not fit a packed row of seq_len={seq_len}; set "
                f"data.cutoff_len <= seq_len"
            )
        slot = bisect_left(free, (n, -1))
        if slot == len(free):
            rows.append([i])
            room, row = seq_len - n, len(rows) - 1
        else:
            room, row = free.pop(slot)
            rows[row].append(i)
            room -= n
        if room > 0:
            insort(free, (room, row))
    return rows


def packed_batch(
    rows: list[list[Sample]],
    *,
    seq_len: int,
    pad_token_id: int,
    features: ImageFeatures | None = None,
) -> Batch:
    """One micro-batch of packed rows, each exactly `seq_len` tokens (see module docstring)."""
    input_ids = np.full((len(rows), seq_len), pad_token_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((len(rows), seq_len), dtype=np.int64)
    for r, samples in enumerate(rows):
        start = 0
        for sample in samples:
            end = start + sample.num_tokens
            input_ids[r, start:end] = sample.input_ids
            labels[r, start:end] = sample.labels()
            labels[r, start] = IGNORE_INDEX
            position_ids[r, start:end] = np.arange(sample.num_tokens)
            start = end
        assert start <= seq_len, (start, seq_len)
        position_ids[r, start:] = np.arange(seq_len - start)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        attention_mask=None,
        position_ids=torch.from_numpy(position_ids),
        images=_images([sample for row in rows for sample in row], features),
    )


def padded_batch(
    samples: list[Sample],
    *,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
    max_len: int,
    features: ImageFeatures | None = None,
) -> Batch:
    """One micro-batch right-padded to its longest sample (see module docstring)."""
    longest = max(s.num_tokens for s in samples)
    assert longest <= max_len, (longest, max_len)
    width = min(-(-longest // pad_to_multiple_of) * pad_to_multiple_of, max_len)
    input_ids = np.full((len(samples), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(samples), width), IGNORE_INDEX, dtype=np.int64)
    attention_mask = np.zeros((len(samples), width), dtype=np.int64)
    for r, sample in enumerate(samples):
        n = sample.num_tokens
        input_ids[r, :n] = sample.input_ids
        labels[r, :n] = sample.labels()
        attention_mask[r, :n] = 1
    position_ids = np.broadcast_to(np.arange(width, dtype=np.int64), (len(samples), width))
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        attention_mask=torch.from_numpy(attention_mask),
        position_ids=torch.from_numpy(position_ids.copy()),
        images=_images(samples, features),
    )
