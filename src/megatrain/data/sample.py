"""`Sample`, one tokenized conversation, and `DataStats`, the counts of the data preparation.

A sample stores token ids (int32) and a boolean target mask instead of int64 labels: a third of
the memory for large data sets. `labels()` gives the Hugging Face form (-100 where not
supervised, unshifted).

Invariant: a sample's supervised-token count is `target_mask[1:].sum()`, the same count as
`Batch.num_target_tokens` (the first position of a sample never carries loss), so the statistics
equal what the loss sees.

Vision-language samples keep their images as file paths with each image's token count, never
pixels: `input_ids` hold each image's tokens expanded (`image_tokens[i]` consecutive image token
ids for image i, in the order of `images`), none of them supervised; the pixel values are
computed when a micro-batch is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatrain.batch import IGNORE_INDEX


@dataclass(frozen=True, eq=False)
class Sample:
    input_ids: np.ndarray  # [T] int32
    target_mask: np.ndarray  # [T] bool: True where the token is supervised
    truncated: bool = False
    images: tuple[str, ...] = ()  # absolute image paths, in the order of their tokens
    image_tokens: tuple[int, ...] = ()  # tokens of each image in input_ids

    def __post_init__(self) -> None:
        assert self.input_ids.shape == self.target_mask.shape and self.input_ids.ndim == 1
        assert len(self.images) == len(self.image_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_target_tokens(self) -> int:
        return int(self.target_mask[1:].sum())

    def labels(self) -> np.ndarray:
        """[T] int64, IGNORE_INDEX where not supervised."""
        return np.where(self.target_mask, self.input_ids.astype(np.int64), IGNORE_INDEX)


@dataclass
class DataStats:
    """What happened to the rows read: kept, dropped by reason, truncated, token counts."""

    rows_read: int = 0
    kept: int = 0
    extra_rows: int = 0  # rows beyond one per kept conversation (data.multi_turn: per_turn)
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    num_tokens: int = 0
    num_target_tokens: int = 0

    first_drop: str = ""  # where the first dropped row is and why: "row 7 (over_cutoff_len)"

    def drop(self, reason: str, row: int | None = None) -> None:
        """Count a dropped row; `row`: its 1-based number in its data set (the first is named)."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if row is not None and not self.first_drop:
            self.first_drop = f"row {row} ({reason})"

    def keep(self, sample: Sample, *, extra_row: bool = False) -> None:
        """Count a kept row; `extra_row`: a further row of a conversation already counted."""
        if extra_row:
            self.extra_rows += 1
        else:
            self.kept += 1
        self.truncated += int(sample.truncated)
        self.num_tokens += sample.num_tokens
        self.num_target_tokens += sample.num_target_tokens

    def keep_group(self, samples: list[Sample]) -> None:
        """Count one kept row made of several samples (a preference pair): truncated if any is."""
        self.kept += 1
        self.truncated += int(any(s.truncated for s in samples))
        self.num_tokens += sum(s.num_tokens for s in samples)
        self.num_target_tokens += sum(s.num_target_tokens for s in samples)

    def add(self, other: DataStats) -> None:
        """Accumulate the counts of `other` (another data set or file) into these."""
        self.rows_read += other.rows_read
        self.kept += other.kept
        self.extra_rows += other.extra_rows
        self.truncated += other.truncated
        self.num_tokens += other.num_tokens
        self.num_target_tokens += other.num_target_tokens
        for reason, count in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        self.first_drop = self.first_drop or other.first_drop

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def to_dict(self) -> dict[str, object]:
        return {
            "rows_read": self.rows_read,
            "kept": self.kept,
            "extra_rows": self.extra_rows,
            "dropped": dict(sorted(self.dropped.items())),
            "truncated": self.truncated,
            "num_tokens": self.num_tokens,
            "num_target_tokens": self.num_target_tokens,
        }

    def describe(self) -> str:
        """One line for logs and the `megatrain data` summary."""
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        return (
            f"rows {self.rows_read}, kept {self.kept}"
            + (f" (+{self.extra_rows} per-turn rows)" if self.extra_rows else "")
            + f", dropped {self.num_dropped} ({reasons}), "
            f"truncated {self.truncated}, tokens {self.num_tokens}, "
            f"supervised tokens {self.num_target_tokens}"
        )


def held_out_mask(n: int, *, val_size: float, seed: int, unit: str) -> np.ndarray:
    """Which of `n` items a seeded random draw of `val_size` (a fraction < 1 or a count) holds
    out for evaluation; ValueError naming data.val_size when nothing would be left to train."""
    count = max(1, round(val_size * n)) if val_size < 1 else int(val_size)
    if count >= n:
        raise ValueError(
            f"data.val_size={val_size} takes {count} of the {n} {unit} and leaves none to train "
            "on; lower it"
        )
    held_out = np.zeros(n, dtype=np.bool_)
    held_out[np.random.default_rng(seed).permutation(n)[:count]] = True
    return held_out


def image_share(samples: object) -> float:
    """The share of the samples' tokens that are image tokens (0 for text data)."""
    if not isinstance(samples, list):
        return 0.0  # a pre-training corpus: text
    tokens = sum(s.num_tokens for s in samples)
    images = sum(sum(s.image_tokens) for s in samples)
    return images / tokens if tokens else 0.0
