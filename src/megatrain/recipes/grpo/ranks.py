"""GRPO under torchrun: each rank's share of a generation batch, and what is summed over ranks.

A generation batch is `prompts_per_step` prompts x `num_generations` completions, its rows in
the order one process has them (prompt after prompt, each prompt's group together). Rank r of W
takes the contiguous r-th W-th of those rows (`rank_rows`): whole prompt groups, since
prompts_per_step is a multiple of W (`check_world`), so a group is never split. Each rank
samples its rows' completions (seeded by `rollout_seed`, a pure function of the batch and the
rank) and scores them; `job_rows` then gives every rank the whole batch's per-row values (the
rows of rank r at its place, in one process's order), so advantages (group or batch scaling)
and the batch's metrics are computed from the same numbers as in one process, on every rank.

Training is data-parallel on the sharded store (engine/collectives.py): the gradient and the
loss are summed over the ranks, so each rank's token weights carry the whole batch's
normalisation (recipes/grpo/loss.py `token_weights` with `job_totals`) and the ranks' sums add
up to one process's loss. The loss's token statistics (KL, clipping, entropy) are summed over
the ranks by `job_stats`.

Invariant: every rank calls these collectives the same number of times, in the same order
(each rank has as many rows, and each function is called once per generation batch or step).
A world of one is the same code path: every function is then the identity.
"""

from __future__ import annotations

import torch

from megatrain.distributed import rank_sums
from megatrain.recipes.grpo.loss import GRPOStats


def check_world(prompts_per_step: int, world_size: int) -> None:
    """Refuse a rank count that would split a generation batch's prompts unevenly."""
    if prompts_per_step % world_size == 0:
        return
    fits = [w for w in range(1, prompts_per_step + 1) if prompts_per_step % w == 0]
    larger = -(-prompts_per_step // world_size) * world_size
    raise ValueError(
        f"grpo.prompts_per_step={prompts_per_step} prompts per generation batch do not split "
        f"over {world_size} processes (torchrun's --nproc-per-node x --nnodes): each rank "
        f"samples and trains whole prompt groups (the grpo.num_generations completions of a "
        f"prompt stay on one rank), the same number on every rank; set grpo.prompts_per_step "
        f"to a multiple of {world_size} (e.g. {larger}), or run "
        f"{' or '.join(map(str, fits))} processes"
    )


def rank_rows(rows: int, rank: int, world_size: int) -> slice:
    """Rank `rank`'s contiguous share of a generation batch's `rows` (module docstring)."""
    assert rows % world_size == 0, (rows, world_size)
    share = rows // world_size
    return slice(rank * share, (rank + 1) * share)


def rollout_seed(seed: int, index: int, rank: int, world_size: int) -> int:
    """The sampling seed of rank `rank`'s rows of generation batch `index`: distinct for every
    (batch, rank), and one process's (`seed * 1_000_003 + index`) in a world of one."""
    return (seed * 1_000_003 + index) * world_size + rank


def job_rows(values_NC: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The whole batch's rows [N x world, C] (float64) from this rank's [N, C]: every rank's
    rows at their place. Each entry is one rank's value plus zeros from the others, so the
    sum is exact (NaN stays NaN)."""
    if world_size == 1:
        return values_NC.double()
    n = values_NC.shape[0]
    out = torch.zeros((n * world_size, *values_NC.shape[1:]), dtype=torch.float64)
    out[rank * n : (rank + 1) * n] = values_NC.double()
    summed = rank_sums(out.reshape(-1).tolist())  # sync point
    return torch.tensor(summed, dtype=torch.float64).view_as(out)


def job_totals(sequences: int, tokens: float) -> tuple[int, float]:
    """(sequences, completion tokens) of the whole generation batch from this rank's: the
    denominators of the loss types (integers, exact in float64)."""
    total_sequences, total_tokens = rank_sums([float(sequences), tokens])  # sync point
    return int(total_sequences), total_tokens


def job_stats(stats: GRPOStats, world_size: int) -> GRPOStats:
    """The step's token statistics summed over the ranks (this rank's, in a world of one)."""
    if world_size == 1:
        return stats
    entropy = float(torch.stack(stats.entropy_parts).sum()) if stats.entropy_parts else 0.0
    tokens, kl_sum, low, high, entropy, importance, capped = rank_sums(  # sync point: metrics
        [float(stats.tokens), stats.kl_sum, float(stats.clipped_low), float(stats.clipped_high),
         entropy, stats.importance_sum, float(stats.importance_capped)]
    )  # fmt: skip
    return GRPOStats(
        tokens=int(tokens),
        kl_sum=kl_sum,
        clipped_low=int(low),
        clipped_high=int(high),
        entropy_parts=[torch.tensor(entropy, dtype=torch.float64)],
        importance_sum=importance,
        importance_capped=int(capped),
    )
