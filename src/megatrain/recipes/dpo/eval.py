"""The preference eval: the training loss and its metric sums over the eval pairs, no gradients.

The eval pairs go through the engine in loader order, `grad_accum x world` micro-batches per
pass (rank r takes every world-th; a rank with none repeats the pass's first micro-batch
uncounted, so every rank runs as many forwards, which hold collectives); each pass's share of the
loss divides by the whole set's totals (loss.py's invariant), so the sum over passes and ranks is
the loss of the whole eval set at once. KTO's reference point (kl) is each pass's own (its KL
rows on every rank).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megatrain.data.preference_data import PairLoader
from megatrain.distributed import rank_sums
from megatrain.engine.engine import StreamingEngine
from megatrain.recipes.dpo.loss import StepTotals
from megatrain.recipes.dpo.objective import PreferenceObjective
from megatrain.recipes.dpo.steps import StepPairs, chosen_tokens


def evaluate_pairs(
    engine: StreamingEngine,
    loader: PairLoader,
    objective_of: Callable[[StepPairs], PreferenceObjective],
    *,
    grad_accum: int,
    rank: int,
    world_size: int,
) -> tuple[float, dict[str, float], np.ndarray]:
    """(the eval loss, metric sums of this rank's pairs, every eval pair) over `loader`'s epoch 0
    (an unshuffled loader: the same pairs in the same order at every eval)."""
    groups = [loader.pairs_of(0, s) for s in range(len(loader))]
    every = np.concatenate(groups)
    totals = StepTotals(num_pairs=len(every), chosen_tokens=chosen_tokens(loader, every))
    per_pass = grad_accum * world_size
    loss, sums = 0.0, dict[str, float]()
    for start in range(0, len(groups), per_pass):
        job = groups[start : start + per_pass]
        mine = job[rank::world_size]
        counted = bool(mine)
        if not counted:
            mine = job[:1]
        step = StepPairs([loader.batch_of(p) for p in mine], mine, totals, np.concatenate(mine))
        pref = objective_of(step)
        pref.counted = counted  # a repeated pass adds nothing to KTO's reference point
        _, value = pref.prepare(engine.logprobs(step.batches))
        weight = 1.0 if counted else 0.0  # every rank sums the same keys
        loss += weight * float(value)
        for k, v in pref.metrics.items():
            sums[k] = sums.get(k, 0.0) + weight * v if k != "kl" else v
    (loss,) = rank_sums([loss])
    return loss, sums, every
