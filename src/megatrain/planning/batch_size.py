"""Automatic micro-batch size: the largest one whose predicted GPU peak fits.

With `tokens_per_step` fixed, candidates are the divisors of the step's rows
(tokens_per_step / seq_len), so micro_batch_size x grad_accum keeps the step's tokens exactly;
the boundary activations (L x tokens per step x D) are the same for every candidate, only the
per-micro-batch transients change. With `grad_accum` fixed instead, candidates are powers of
two up to `max_micro_batch_size`, and the step grows with the micro-batch. The predicted peak
grows with the micro-batch size, so a binary search over the candidates finds the largest.
"""

from __future__ import annotations

from dataclasses import replace

from megatrain.planning.estimate import Estimate, estimate
from megatrain.planning.fit import gpu_problem
from megatrain.planning.hardware import GIB, Hardware, gib
from megatrain.planning.setup import Setup
from megatrain.planning.spec import ModelSpec


def pick_micro_batch(
    spec: ModelSpec,
    setup: Setup,
    *,
    tokens_per_step: int | None = None,
    grad_accum: int | None = None,
    hardware: Hardware,
    gpu_margin_gib: float,
    max_micro_batch_size: int = 64,
    rows_multiple: int = 1,
) -> tuple[int, int, str]:
    """(micro_batch_size, grad_accum, reason). Raises ValueError, with the numbers and what to
    change, when not even the smallest candidate fits. Every candidate is `setup` with its
    micro-batch size and accumulation, a multiple of `rows_multiple` (rows that share a
    micro-batch: a preference pair's chosen and rejected)."""
    seq_len = setup.seq_len
    if (tokens_per_step is None) == (grad_accum is None):
        raise ValueError("give exactly one of tokens_per_step and grad_accum")
    if tokens_per_step is not None:
        rows = tokens_per_step // seq_len
        if rows < 1 or rows * seq_len != tokens_per_step:
            raise ValueError(
                f"tokens_per_step ({tokens_per_step}) must be a multiple of seq_len ({seq_len})"
            )
        candidates = [
            (b, rows // b) for b in range(rows_multiple, rows + 1, rows_multiple) if rows % b == 0
        ]
        if not candidates:
            raise ValueError(
                f"training.global_batch_size gives {rows} rows per step (per rank), but a "
                f"micro-batch holds a multiple of {rows_multiple} (a preference pair's rows "
                f"share one): make the rows per step a multiple of {rows_multiple}"
            )
    else:
        assert grad_accum is not None
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        candidates = [
            (1 << k, grad_accum)
            for k in range(max_micro_batch_size.bit_length())
            if rows_multiple <= 1 << k <= max_micro_batch_size and (1 << k) % rows_multiple == 0
        ]
    budget = hardware.gpu_bytes - gpu_margin_gib * GIB

    def predict(i: int) -> Estimate:
        b, ga = candidates[i]
        return estimate(spec, replace(setup, micro_batch_size=b, grad_accum=ga), hardware)

    smallest = predict(0)
    problem = gpu_problem(smallest, hardware, gpu_margin_gib)
    if problem is not None:
        b, ga = candidates[0]
        raise ValueError(f"no micro-batch size fits, not even {b} (x grad_accum {ga}): {problem}")
    lo, hi, best = 0, len(candidates) - 1, smallest  # invariant: candidates[lo] fits
    too_big: Estimate | None = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        guess = predict(mid)
        if guess.gpu.peak_bytes <= budget:
            lo, best = mid, guess
        else:
            hi, too_big = mid - 1, guess
    b, ga = candidates[lo]
    if lo + 1 < len(candidates) and (
        too_big is None or too_big.settings["micro_batch_size"] != candidates[lo + 1][0]
    ):
        too_big = predict(lo + 1)
    reason = (
        f"micro_batch_size {b} x grad_accum {ga} ({b * ga * seq_len} tokens/step): "
        f"predicted GPU peak {gib(best.gpu.peak_bytes)} of {gib(hardware.gpu_bytes)} "
        f"(margin {gpu_margin_gib:g} GiB)"
    )
    if too_big is not None:
        reason += (
            f"; {too_big.settings['micro_batch_size']} would need {gib(too_big.gpu.peak_bytes)}"
        )
    else:
        reason += "; the largest candidate"
    return b, ga, reason
