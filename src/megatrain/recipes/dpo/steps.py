"""The pairs of each optimizer step, and what the step's loss divides by (pure; no engine).

The job's micro-batches are the PairLoader's, in order, epoch after epoch: a step takes the next
`grad_accum x world` of them and rank r builds every world-th one (r, r + world, ...), as
data/ranks.py splits SFT micro-batches. Every rank reads every index (not the rows), so the
step's totals (pairs, chosen tokens: the denominators of loss.py) are known on every rank without
a collective, and a one-process run with `grad_accum x world` accumulation takes the same steps.

The position is the loader's own (`epoch`, `step`: the next micro-batch), so its `state_dict` is
the resume point: a checkpoint of step N resumes at step N + 1's first micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.data.preference_data import PairLoader
from megatrain.recipes.dpo.loss import StepTotals


@dataclass
class StepPairs:
    """One step: this rank's micro-batches, their pair indices, and the job's totals."""

    batches: list[Batch]
    pairs: list[np.ndarray]  # per micro-batch of this rank: pair k is rows 2k, 2k + 1
    totals: StepTotals
    job_pairs: np.ndarray  # every pair of the step, every rank's


def next_pairs(loader: PairLoader, count: int) -> list[np.ndarray]:
    """The pair indices of the loader's next `count` micro-batches; the position advances."""
    out = []
    for _ in range(count):
        if loader.step >= len(loader):  # the epoch is done: the next one's order
            loader.epoch, loader.step = loader.epoch + 1, 0
        out.append(loader.pairs_of(loader.epoch, loader.step))
        loader.step += 1
    return out


def chosen_tokens(loader: PairLoader, pairs: np.ndarray) -> int:
    """Supervised tokens of the chosen rows of `pairs`, as the engine counts them (labels from
    position 1: position 0 predicts nothing)."""
    rows = (loader.samples[2 * int(i)] for i in pairs)
    return int(sum((s.labels()[1:] != IGNORE_INDEX).sum() for s in rows))


def step_pairs(loader: PairLoader, *, grad_accum: int, rank: int, world_size: int) -> StepPairs:
    """The next optimizer step's pairs (module docstring); builds this rank's batches only."""
    job = next_pairs(loader, grad_accum * world_size)
    mine = job[rank::world_size]
    every = np.concatenate(job)
    totals = StepTotals(num_pairs=len(every), chosen_tokens=chosen_tokens(loader, every))
    return StepPairs([loader.batch_of(p) for p in mine], mine, totals, every)
