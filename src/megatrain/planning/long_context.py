"""The long-row memory plan: where each layer's saved input waits, and the MLP's sequence tiles.

The saved inputs (boundary activations, engine/boundaries.py) grow with the step's tokens:
L x T x D x c bytes, 4 GiB per layer of an 8B model at 512k tokens. Given the GPU room the rest
of the run leaves (weights slots, accumulators, one layer's transient) and the host room the
store leaves, `choose_boundaries` picks, GPU first and host second:
- offload "off": every kept input on the GPU; "on": every kept input on the host; "auto": as
  many as fit on the GPU, the rest on the host;
- one kept every K layers, K the smallest that fits (or the configured one).

At the backward's peak the device holds the GPU-kept inputs and the current segment's K inputs
(its start fetched back from the host when offloaded, K - 1 recomputed), or an offloaded start
and the next one being prefetched: `device_inputs` counts them. The offloaded inputs are host
buffers of one micro-batch's input each, pinned on CUDA (`host_input_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatrain.choices import OFFLOAD_CHOICES
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.planning.hardware import gib


def device_inputs(plan: BoundaryPlan) -> int:
    """Saved inputs (per micro-batch) on the device at the backward's peak.

    The GPU-kept inputs are the last segments' starts, consumed first: their peak is all of
    them plus the K - 1 recomputed inputs of the last segment. An offloaded segment holds its
    K inputs (its start fetched back), and during its start layer's backward that start plus
    the next segment's start being prefetched: 2.
    """
    peak = plan.count("gpu") + plan.every - 1
    return max(peak, plan.every, 2) if plan.count("host") else peak


def host_input_bytes(
    plan: BoundaryPlan, input_bytes: int, micro_batches: int, reserved: Callable[[int], int]
) -> int:
    """Host bytes of the offloaded inputs (`reserved`: what one buffer of n bytes costs)."""
    return plan.count("host") * micro_batches * reserved(input_bytes)


def configured_boundaries(
    num_layers: int, offload: str, every: int | str, on_cuda: bool
) -> BoundaryPlan | None:
    """The plan straight from memory.activation_offload and memory.checkpoint_every when
    neither is "auto" (on the CPU "auto" keeps every input: the device is the host); None:
    the run's resource plan decides."""
    if not on_cuda:
        every = 1 if every == "auto" else every
        offload = "off" if offload == "auto" else offload
    if every == "auto" or offload == "auto":
        return None
    kept = -(-num_layers // int(every))
    return BoundaryPlan.make(num_layers, every=int(every), on_host=kept if offload == "on" else 0)


def choose_boundaries(
    num_layers: int,
    *,
    input_bytes: int,
    micro_batches: int,
    gpu_free_bytes: float,
    host_free_bytes: float,
    offload: str,
    every: int | str,
    reserved: Callable[[int], int] = lambda n: n,
) -> tuple[BoundaryPlan, str]:
    """The plan (and why) for inputs of `input_bytes` per micro-batch and layer, given the GPU
    and host room left for them. When nothing fits: the plan that needs the least of the GPU
    among those the host holds (most offloaded, smallest K), else the largest K; the fit
    check then reports the overflow."""
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"memory.activation_offload={offload!r} must be auto, on or off")
    per_layer_gpu = input_bytes * micro_batches
    per_layer_host = reserved(input_bytes) * micro_batches
    candidates = [int(every)] if every != "auto" else list(range(1, num_layers + 1))
    plan = BoundaryPlan.make(num_layers, every=candidates[-1])
    fallback: tuple[int, BoundaryPlan] | None = None  # (device inputs, plan) the host holds
    for k in candidates:
        kept = math.ceil(num_layers / k)
        if offload == "off":
            options = [0]
        elif offload == "on":
            options = [kept]
        else:  # GPU first: the fewest on the host that still fit the GPU
            options = list(range(kept + 1))
        for on_host in options:
            plan = BoundaryPlan.make(num_layers, every=k, on_host=on_host)
            gpu = device_inputs(plan) * per_layer_gpu
            host = plan.count("host") * per_layer_host
            if gpu <= gpu_free_bytes and host <= host_free_bytes:
                return plan, _reason(plan, per_layer_gpu, gpu_free_bytes, host_free_bytes)
            if host <= host_free_bytes and (fallback is None or gpu < fallback[0]):
                fallback = (gpu, plan)
    plan = plan if fallback is None else fallback[1]
    return plan, "does not fit: " + _reason(plan, per_layer_gpu, gpu_free_bytes, host_free_bytes)


def _reason(plan: BoundaryPlan, per_layer: int, gpu_free: float, host_free: float) -> str:
    return (
        f"{plan.describe()}; {gib(per_layer)} per layer input, room {gib(max(gpu_free, 0))} "
        f"on the GPU and {gib(max(host_free, 0))} on the host"
    )


def longest_fitting(fits: Callable[[int], bool], low: int, high: int, step: int) -> int | None:
    """The largest multiple of `step` in [low, high] for which `fits` holds (None: not even
    `low`), assuming that what fits at a length fits at every shorter one. Doubling from `low`
    until a length does not fit, then halving the interval: a plan costs more the longer its
    row (more tiles to profile), so the search never plans a row over twice the answer."""
    lo, hi = -(-low // step), high // step
    if lo > hi or not fits(lo * step):
        return None
    while lo < hi:
        probe = min(2 * lo, hi)
        if not fits(probe * step):
            hi = probe - 1
            break
        lo = probe
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step
