"""Prompt + completion token lists -> the engine's micro-batches, and per-token side inputs.

Each sequence is one row: its prompt tokens, then its completion tokens (the end-of-sequence
token included when it was generated), right-padded to the micro-batch's longest row. Only the
completion tokens are targets (labels); prompt and padding are IGNORE_INDEX and not attended
past the row's end. Rows keep the order they are given in, `micro_batch_size` to a micro-batch;
the recipe gives them in `length_order`: where a generation batch takes several micro-batches,
rows of like length share one, so less of each is padding (the step's loss is a sum over rows:
the order changes only its rounding).
"""

from __future__ import annotations

import torch

from megatrain.batch import IGNORE_INDEX, Batch


def sequence_batches(
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    micro_batch_size: int,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
) -> list[Batch]:
    """Micro-batches of the rows prompt_i + completion_i (see the module docstring)."""
    assert len(prompts) == len(completions) and micro_batch_size >= 1
    out = []
    for start in range(0, len(prompts), micro_batch_size):
        rows = [
            (p, c)
            for p, c in zip(
                prompts[start : start + micro_batch_size],
                completions[start : start + micro_batch_size],
                strict=True,
            )
        ]
        width = max(len(p) + len(c) for p, c in rows)
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (p, c) in enumerate(rows):
            n = len(p) + len(c)
            ids[r, :n] = torch.tensor(p + c, dtype=torch.long)
            labels[r, len(p) : n] = torch.tensor(c, dtype=torch.long)
            mask[r, :n] = 1
        out.append(Batch(ids, labels, mask, None))
    return out


def length_order(lengths: list[int], micro_batch_size: int) -> list[int]:
    """The order rows go into micro-batches: longest first (ties in the given order) where
    there is more than one micro-batch, else as given (nothing to group)."""
    if len(lengths) <= micro_batch_size:
        return list(range(len(lengths)))
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def completion_mask(batch: Batch) -> torch.Tensor:
    """1 on the batch's completion (target) tokens, 0 elsewhere; [B, S] int64."""
    return (batch.labels != IGNORE_INDEX).long()


def per_row(values: list[float], batches: list[Batch]) -> list[torch.Tensor]:
    """One value per sequence spread over its completion tokens: fp32 [B, S] per micro-batch."""
    out, start = [], 0
    for b in batches:
        rows = torch.tensor(values[start : start + b.input_ids.shape[0]], dtype=torch.float32)
        out.append(rows[:, None] * completion_mask(b).float())
        start += b.input_ids.shape[0]
    assert start == len(values), "one value per sequence"
    return out


def per_token(values: list[list[float]], batches: list[Batch]) -> list[torch.Tensor]:
    """One value per completion token (sequence i's j-th at its j-th target): fp32 [B, S] per
    micro-batch, 0 elsewhere (the rollout's log-probs, Rollout.logps)."""
    out, start = [], 0
    for b in batches:
        mask = completion_mask(b).bool()
        rows = torch.zeros(mask.shape, dtype=torch.float32)
        for r in range(mask.shape[0]):
            rows[r, mask[r]] = torch.tensor(values[start + r], dtype=torch.float32)
        out.append(rows)
        start += b.input_ids.shape[0]
    assert start == len(values), "one row of values per sequence"
    return out
