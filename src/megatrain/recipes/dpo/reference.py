"""The reference log-probs, without a second model anywhere: precomputed (dpo.reference:
precomputed, TRL's precompute_ref_log_probs) or from a host copy of the initial weights per step
(dpo.reference: weights, `weights_reference`: GRPO's ReferenceWeights swapped into the store for
one forward-only pass over the step's own micro-batches).

Before the first step, the initial weights stream through the engine without gradients over
every pair, in pair order, `micro_batches_per_pass` micro-batches per pass (each pass streams
every layer once, as a training step's forward does); each row's sum of completion-token
log-probs is kept: a table fp32 [num_pairs, 2] (chosen, rejected), 8 bytes per pair on the host.
A step then looks its pairs up by index (`PairLoader.pairs_of`), whatever the shuffle.

Several ranks share the work: each pass covers `micro_batches_per_pass x world_size`
micro-batches, rank r computing every world-th; each rank's rows of the table are then summed
over the ranks (a row is computed on one rank and zero on the others, so the sum is exact). A
rank with no micro-batch in the last pass repeats one uncounted: every rank runs as many
forwards, which hold collectives.

`precompute_reference` returns the table and the tokens the pass computed on (each counted
micro-batch's padded rows, summed over the ranks, as a training step's `tokens` count them).

Invariant: table[i] is pair i's (chosen, rejected) under the weights the engine held when the
table was made; a pair's value does not depend on which micro-batch computed it beyond
floating-point rounding of the padded width (fp32: relative ~1e-6).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from megatrain.batch import Batch
from megatrain.data.preference_data import PairLoader
from megatrain.distributed import rank_sums
from megatrain.engine.engine import StreamingEngine
from megatrain.recipes.dpo.objective import sequence_logps
from megatrain.store.reference import ReferenceWeights


class ReferenceTable(NamedTuple):
    table: torch.Tensor  # fp32 [num_pairs, 2]: (chosen, rejected) log-prob sums, pair order
    tokens: int  # tokens the pass computed on (padded rows), every rank's


def precompute_reference(
    engine: StreamingEngine,
    loader: PairLoader,
    *,
    micro_batches_per_pass: int,
    rank: int = 0,
    world_size: int = 1,
) -> ReferenceTable:
    """Each pair's (chosen, rejected) log-prob sums, in pair order (every rank gets the whole
    table), and the pass's tokens."""
    assert micro_batches_per_pass >= 1
    num_pairs, per_batch = loader.num_rows, loader.micro_batch_size
    table = torch.zeros(num_pairs, 2, dtype=torch.float32)
    groups = [np.arange(s, min(s + per_batch, num_pairs)) for s in range(0, num_pairs, per_batch)]
    per_pass, tokens = micro_batches_per_pass * world_size, 0
    for start in range(0, len(groups), per_pass):
        picked = groups[start : start + per_pass][rank::world_size]
        counted = bool(picked)
        picked = picked or groups[start : start + 1]
        batches = [loader.batch_of(p) for p in picked]
        sums = sequence_logps(engine.logprobs(batches), batches)
        if counted:
            tokens += sum(b.num_tokens for b in batches)
            for pairs, rows in zip(picked, sums, strict=True):
                table[torch.from_numpy(pairs)] = rows.view(-1, 2)
    if world_size > 1:  # the token count rides along (exact in float64)
        *values, total = rank_sums([*table.view(-1).tolist(), float(tokens)])
        table, tokens = torch.tensor(values, dtype=torch.float32).view(num_pairs, 2), int(total)
    return ReferenceTable(table, tokens)


def reference_rows(table: torch.Tensor, pairs: np.ndarray) -> torch.Tensor:
    """fp32 [2P]: the rows of the micro-batch of `pairs`, interleaved (chosen, rejected)."""
    return table[torch.from_numpy(np.asarray(pairs))].reshape(-1)


def weights_reference(
    engine: StreamingEngine, weights: ReferenceWeights, batches: list[Batch]
) -> list[torch.Tensor]:
    """Per micro-batch, fp32 [2P]: its rows' log-prob sums under `weights` (dpo.reference:
    weights), interleaved (chosen, rejected) as `reference_rows` gives them.

    Every pending optimizer update is waited for first (a sync point): an update in flight
    would write the store's new weights into whatever its block serves then, the reference
    copy included (StreamingEngine.serving swaps the weights in, the GPU tier's too)."""
    engine.wait_updates()
    with engine.serving(weights):
        logps = engine.logprobs(batches)
    return [rows.float() for rows in sequence_logps(logps, batches)]
