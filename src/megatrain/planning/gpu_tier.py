"""How many blocks the GPU tier of optimizer states holds (engine/tier.py), for "auto".

`pick_tier` takes the most blocks (in engine/plan.py `tier_order`) whose predicted GPU peak
(the allocator's reserved peak, planning/allocator_slack.py) still fits with `gpu_margin_gib`
free, and whose persistent buffers leave `reserve` bytes (GRPO's resident rollout) free beside
them; on the CPU "auto" is 0; a given count is clamped to the model's blocks. The tier keeps
an fp32 master and fp32, bf16 or int8 states (`tier_refusal`, which planning/store_table.py
asks too).
"""

from __future__ import annotations

from collections.abc import Callable

from megatrain.choices import TIER_STATE_DTYPES
from megatrain.engine.plan import tier_size
from megatrain.planning.estimate import Estimate
from megatrain.planning.hardware import GIB, Hardware, gib
from megatrain.planning.run_shape import RunShape
from megatrain.planning.spec import ModelSpec


def tier_refusal(state_dtype: str, master_dtype: str) -> str | None:
    """Why the GPU tier takes no block of this store (None: it may): it keeps the states of
    choices.py TIER_STATE_DTYPES and an fp32 master (config/sections.py refuses a tier given
    with others)."""
    if state_dtype not in TIER_STATE_DTYPES:
        return f"state_dtype {state_dtype}: {', '.join(TIER_STATE_DTYPES)} only"
    if master_dtype != "fp32":
        return f"master_dtype {master_dtype}: fp32 only"
    return None


def pick_tier(
    shape: RunShape,
    spec: ModelSpec,
    predict: Callable[[int], Estimate],
    hardware: Hardware,
    gpu_margin_gib: float,
    reserve: int,
) -> tuple[int, str | None]:
    """The GPU tier's block count, and why "auto" chose it (None: it was given)."""
    blocks = tier_size(spec.num_layers)
    if shape.gpu_state_blocks != "auto":
        return min(int(shape.gpu_state_blocks), blocks), None
    refused = tier_refusal(shape.state_dtype, shape.master_dtype)
    if refused:
        return 0, f"GPU tier: none ({refused})"
    return _most_that_fit(predict, blocks, shape.check_gpu, hardware, gpu_margin_gib, reserve)


def _most_that_fit(
    predict: Callable[[int], Estimate],
    num_blocks: int,
    on_gpu: bool,
    hardware: Hardware,
    gpu_margin_gib: float,
    reserve: int = 0,
) -> tuple[int, str]:
    """The most blocks (tier order) whose GPU-tier states fit beside the run, and beside
    `reserve` bytes next to the persistent buffers, and why.

    The predicted peak grows with the count (each block adds 8-16 B/param and frees at most
    its share of a slot), so a binary search finds the largest that fits.
    """
    if not on_gpu:
        return 0, "GPU tier: none (no GPU)"
    budget = hardware.gpu_bytes - gpu_margin_gib * GIB
    lo, hi = 0, num_blocks  # invariant: lo fits, or lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        gpu = predict(mid).gpu
        if gpu.peak_bytes <= budget and gpu.persistent_bytes + reserve <= budget:
            lo = mid
        else:
            hi = mid - 1
    peak = predict(lo).gpu.peak_bytes
    return lo, (
        f"GPU tier: {lo} of {num_blocks} blocks, predicted GPU peak {gib(peak)} of "
        f"{gib(hardware.gpu_bytes)} (margin {gpu_margin_gib:g} GiB"
        + (f", {gib(reserve)} left for the rollout)" if reserve else ")")
    )
