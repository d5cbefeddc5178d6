"""The micro-batch iterator: deterministic per epoch, resumable mid-epoch to the exact batch.

An epoch is a fixed list of micro-batches of `micro_batch_size` rows (the last one may have
fewer). Packed: the rows of `pack_rows` (fixed for the data set), shuffled per epoch. Padded: the
samples, shuffled per epoch. The shuffle is `numpy.random.default_rng([seed, epoch])`, so epoch e
is the same on every run and every machine, and different from epoch e + 1.

Resume: `state_dict()` is {"epoch", "step"} (the next micro-batch to yield) plus a fingerprint of
the data and settings; `load_state_dict()` restores the position and refuses a fingerprint that
differs, since the same position would then name different batches. Taking the state after the
last batch of an epoch gives (epoch + 1, 0).

Images: when samples hold images, micro-batches are built (pixels decoded and processed by
`vision.features`) on a prefetch thread, DEPTH micro-batches ahead (data/prefetch.py), in the same
order; `step` still counts the micro-batches yielded, so the state is the same as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from megatrain.batch import Batch
from megatrain.data.packing import packed_batch, padded_batch
from megatrain.data.prefetch import prefetched
from megatrain.data.sample import Sample
from megatrain.data.vision import VisionProcessor


class BatchLoader:
    """Iterate: the remaining micro-batches of the current epoch, then the epoch advances."""

    def __init__(
        self,
        samples: list[Sample],
        *,
        rows: list[list[int]] | None,
        micro_batch_size: int,
        seq_len: int,
        pad_token_id: int,
        pad_to_multiple_of: int,
        shuffle: bool,
        seed: int,
        vision: VisionProcessor | None = None,
    ) -> None:
        self.samples = samples
        self.num_images = sum(len(s.images) for s in samples)
        assert vision is not None or not self.num_images, "samples with images need `vision`"
        self.vision = vision
        self.rows = rows  # packing plan; None: padded batches of single samples
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.step = 0

    @property
    def packing(self) -> bool:
        return self.rows is not None

    @property
    def num_rows(self) -> int:
        """Rows per epoch: packed rows, or samples when padding."""
        return len(self.rows) if self.rows is not None else len(self.samples)

    def __len__(self) -> int:
        """Micro-batches per epoch."""
        return -(-self.num_rows // self.micro_batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch`: a permutation of range(num_rows)."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def _make_batch(self, picked: np.ndarray) -> Batch:
        features = None if self.vision is None else self.vision.features
        if self.rows is not None:
            rows = [[self.samples[i] for i in self.rows[r]] for r in picked]
            return packed_batch(
                rows, seq_len=self.seq_len, pad_token_id=self.pad_token_id, features=features
            )
        return padded_batch(
            [self.samples[i] for i in picked],
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            max_len=self.seq_len,
            features=features,
        )

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.iterate():
            assert batch is not None
            yield batch

    def iterate(self, wanted: Callable[[], bool] | None = None) -> Iterator[Batch | None]:
        """The remaining micro-batches of the epoch. `wanted`, asked once per micro-batch in
        order: False yields None in its place, unbuilt (another rank's share, data/ranks.py)."""
        self._roll_over()
        order, b = self.epoch_order(self.epoch), self.micro_batch_size
        picks = (
            order[s * b : (s + 1) * b] if wanted is None or wanted() else None
            for s in range(self.step, len(self))
        )
        make = prefetched if self.num_images else _on_this_thread
        for batch in make(self._build, picks):
            self.step += 1  # before the yield: a checkpoint taken now resumes after this batch
            yield batch
        self._roll_over()

    def _build(self, picked: np.ndarray | None) -> Batch | None:
        return None if picked is None else self._make_batch(picked)

    def _roll_over(self) -> None:
        if self.step >= len(self):
            self.epoch, self.step = self.epoch + 1, 0

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a saved position to name the same batches."""
        return {
            "num_samples": len(self.samples),
            "num_tokens": int(sum(s.num_tokens for s in self.samples)),
            "num_rows": self.num_rows,
            "packing": self.packing,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
        } | ({"num_images": self.num_images} if self.num_images else {})

    def state_dict(self) -> dict[str, Any]:
        epoch, step = (self.epoch + 1, 0) if self.step >= len(self) else (self.epoch, self.step)
        return {"epoch": epoch, "step": step, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, current = state["fingerprint"], self.fingerprint()
        changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
            raise ValueError(
                f"data loader state does not match this data and settings ({detail}); resume "
                "with the same data set, data config, micro_batch_size and seq_len"
            )
        if not 0 <= state["step"] <= len(self):
            raise ValueError(f"data loader state step={state['step']} outside 0..{len(self)}")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def _on_this_thread(make: Any, items: Any) -> Iterator[Batch | None]:
    return map(make, items)
