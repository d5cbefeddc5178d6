"""Automatic micro-batch size: the largest one whose predicted GPU peak fits.

On the CPU (`on_host`) the step's buffers and activations are host memory too: the largest
micro-batch whose predicted step peak fits in host RAM beside everything else the run holds
there (the store, the data), less `host_margin_gib`.

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
    on_host: bool = False,
    host_margin_gib: float = 0.0,
    rows_multiple: int = 1,
) -> tuple[int, int, str]:
    """(micro_batch_size, grad_accum, reason). Raises ValueError, with the numbers and what to
    change, when not even the smallest candidate fits. Every candidate is `setup` with its
    micro-batch size and accumulation, a multiple of `rows_multiple` (rows that share a
    micro-batch: a preference pair's chosen and rejected)."""
    seq_len = setup.seq_len
    candidates = _candidates(
        seq_len, tokens_per_step, grad_accum, max_micro_batch_size, rows_multiple
    )
    if on_host:
        memory, total, margin_gib = "host RAM (a CPU run)", hardware.host_bytes, host_margin_gib
    else:
        memory, total, margin_gib = "GPU", hardware.gpu_bytes, gpu_margin_gib
    budget = total - margin_gib * GIB
    of = "" if on_host or "gpu_bytes" in hardware.measured else "an assumed "  # no GPU here

    def need(est: Estimate) -> int:
        """The step's peak where it runs: on the CPU beside the host's store and data."""
        return est.gpu.peak_bytes + (est.host.total_bytes if on_host else 0)

    def predict(i: int) -> Estimate:
        b, ga = candidates[i]
        return estimate(spec, replace(setup, micro_batch_size=b, grad_accum=ga), hardware)

    smallest = predict(0)
    problem = gpu_problem(smallest, hardware, gpu_margin_gib) if not on_host else None
    if on_host and need(smallest) > budget:
        problem = (
            f"host RAM: predicted {gib(need(smallest))} (the step's buffers and activations "
            f"{gib(smallest.gpu.peak_bytes)} + the store and data "
            f"{gib(smallest.host.total_bytes)}) > {gib(budget)} available"
        )
    if problem is not None:
        b, ga = candidates[0]
        raise ValueError(f"no micro-batch size fits, not even {b} (x grad_accum {ga}): {problem}")
    lo, hi, best = 0, len(candidates) - 1, smallest  # invariant: candidates[lo] fits
    too_big: Estimate | None = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        guess = predict(mid)
        if need(guess) <= budget:
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
        f"predicted {memory} peak {gib(need(best))} of {of}{gib(total)} (margin {margin_gib:g} GiB)"
    )
    if too_big is not None:
        reason += f"; {too_big.settings['micro_batch_size']} would need {gib(need(too_big))}"
    else:
        reason += "; the largest candidate"
    return b, ga, reason


def _candidates(
    seq_len: int,
    tokens_per_step: int | None,
    grad_accum: int | None,
    max_micro_batch_size: int,
    rows_multiple: int = 1,
) -> list[tuple[int, int]]:
    """(micro_batch_size, grad_accum) pairs to choose from, smallest micro-batch first; every
    micro-batch a multiple of `rows_multiple` rows (a preference pair's rows share one)."""
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
        return candidates
    assert grad_accum is not None
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    return [
        (1 << k, grad_accum)
        for k in range(max_micro_batch_size.bit_length())
        if rows_multiple <= 1 << k <= max_micro_batch_size and (1 << k) % rows_multiple == 0
    ]
