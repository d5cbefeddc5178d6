"""Each rank's share of the training micro-batches: rank r of W takes every W-th one.

The underlying loader's micro-batch stream (epoch after epoch, deterministic) is read in
groups of W consecutive micro-batches; rank r yields the r-th of each group. So one optimizer
step of A micro-batches per rank covers A x W consecutive micro-batches of that stream, the
same ones a single-process run with accumulation A x W takes in that step: the global batch
is micro-batch x accumulation x world, and a run on W ranks sees exactly the data of the
one-process run with the same global batch. Groups run across epoch boundaries, so every rank
gets the same number of micro-batches. An epoch is counted in the job's micro-batches (`len`),
so a run of `num_epochs` takes the steps, rows and learning rates of that one-process run.

Every rank reads the whole stream but builds only its own micro-batches (the others are
skipped unbuilt: no pixels decoded for another rank's images); the state is the underlying
loader's position, identical on all ranks, plus the world size (a checkpoint resumes with the
same one).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from megatrain.batch import Batch
from megatrain.data.loader import BatchLoader


class RankLoader:
    """Rank `rank`'s micro-batches of `loader` (an endless stream; `len` is per epoch)."""

    def __init__(self, loader: BatchLoader, *, rank: int, world_size: int) -> None:
        assert 0 <= rank < world_size, (rank, world_size)
        self.loader = loader
        self.rank = rank
        self.world_size = world_size
        self._stream: Iterator[Batch | None] | None = None

    def __len__(self) -> int:
        """The job's micro-batches per epoch, every rank's together (this rank takes 1 in
        world_size of them): what one process with world_size times the accumulation counts,
        so both run the same number of steps."""
        return len(self.loader)

    def _endless(self) -> Iterator[Batch | None]:
        taken = itertools.count()  # micro-batches of the stream since it (re)started

        def mine() -> bool:
            return next(taken) % self.world_size == self.rank

        while True:
            yield from self.loader.iterate(mine)

    def __iter__(self) -> Iterator[Batch]:
        if self._stream is None:
            self._stream = self._endless()
        stream = self._stream
        while True:
            batch = [next(stream) for _ in range(self.world_size)][self.rank]
            assert batch is not None
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("world_size", 1)
        if saved != self.world_size:
            raise ValueError(
                f"the checkpoint's data position was saved by {saved} rank(s), this run has "
                f"{self.world_size}: resume with the same number of processes "
                f"(torchrun --nproc-per-node x --nnodes = {saved})"
            )
        self.loader.load_state_dict({k: v for k, v in state.items() if k != "world_size"})
        self._stream = None
