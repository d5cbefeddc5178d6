"""The GPU update share's seconds in the step-time model (planning/timing.py).

The share (engine/gpu_share.py: the last `gpu_update_blocks` streamed blocks, head, then
layers from the last) skips a block's gradient copy down and its CPU AdamW; instead its master
and states, as stored, go up (H2D stream) and master, states and weights come back (D2H), with
the AdamW on the GPU in between. The share page-locks what it copies (engine/gpu_share.py
`_pin`), so it crosses the link at the pinned rates; a block goes up once its staging set's
previous block is back (the plan's `share_sets` sets, taken in turn: planning/replay.py). The
AdamW is the fused Triton kernel for the formats it takes (engine/gpu_share.py `runs_fused`):
`fused_bytes` at GPU_FUSED_BYTES_PER_S; else the torch reference: GPU_REFERENCE_BYTES_PER_PARAM
at planning/layer_time.py HBM_FRACTION of the GPU's memory bandwidth, as other unfused kernels.
The share's slowing of the compute beside it is not counted (run 72, GPT-OSS-20B at 17 layers
with int8 states and a share of 5 blocks on an H200: the share's GPU span 1.04 s a step against
1.12 s planned).
planning/gpu_share.py picks the count for "auto".
"""

from __future__ import annotations

from megatrain.engine.gpu_share import BlockFormats, Parts, runs_fused, share_of
from megatrain.planning.layer_time import HBM_FRACTION

GPU_REFERENCE_BYTES_PER_PARAM = {
    ("fp32", "fp32"): 272,
    ("fp32", "bf16"): 2552,
    ("fp32", "int8"): 498,
    ("fp32", "int4"): 501,
    ("bf16", "fp32"): 1465,
    ("bf16", "bf16"): 3745,
    ("bf16", "int8"): 1691,
    ("bf16", "int4"): 1694,
}
"""Bytes the GPU update share's AdamW moves through GPU memory per parameter, by (master dtype,
state dtype): the torch reference of the C kernels (optim/update_io.py), unfused, counted on
the CPU (2026-11-28: a TorchDispatchMode summing every op's tensor arguments and results over
`CpuAdamW.update_reference` on a 2M-value block in one chunk; a bf16 master with int8 held
gradients, an fp32 master with its bf16 gradient). Each bf16 stochastic rounding (bf16 states'
m and v, a bf16 master's weights) costs ~1.2 kB/param: its hash runs on int64 indices."""
SHARE_CPU_SLOWDOWN = 1.2
"""The host AdamW's time while the share's copies run, relative to without: the copies read and
write host memory (up to the link's 50 GB/s each way) that the bandwidth-bound CPU kernel needs.
Measured in docs/performance.md run 59 (one H100, 16-vCPU host): the CPU kernel's seconds per
parameter rose 1.18x with int8 states (9 share blocks) and 1.27x with fp32 states (3 blocks)."""
GPU_FUSED_BYTES_PER_S = 2.0e12
"""What the fused kernel achieves of an H100's memory bandwidth (3.35 TB/s peak; assumed,
measure: docs/performance.md)."""


def fused_bytes(parts: Parts, gradient: Parts) -> int:
    """Bytes the fused kernel moves for a block: its staging parts (master, states, scales,
    shadow) read and written, its held gradient read once."""
    return 2 * sum(k * d.itemsize for d, k in parts) + sum(k * d.itemsize for d, k in gradient)


def share_seconds(
    params: list[int],
    host: list[int],
    share: int,
    formats: BlockFormats,
    weight_bytes: int,
    link_bytes_per_s: tuple[float, float],
    hbm_bytes_per_s: float,
) -> tuple[set[int], list[float], list[float]]:
    """The share's blocks by forward position (embedding 0, layers, head last) and each block's
    seconds up (master and states, then its GPU AdamW) and down (master, states and a bf16
    shadow's weights); 0 for a block outside the share. `params`: every block's parameters;
    `host`: of them, those the host updates (0: a GPU-tier block, never shared); `share`: the
    share's block count; `weight_bytes`: bytes of one weight in the compute dtype;
    `link_bytes_per_s`: the pinned host-to-device and device-to-host rates;
    `hbm_bytes_per_s`: the GPU's memory bandwidth (datasheet)."""
    n = len(params) - 2
    h2d, d2h = link_bytes_per_s
    fused = runs_fused(formats, share=True)
    shared = set(share_of(list(range(1, n + 1)), n + 1, lambda i: host[i] > 0, share))
    up_s, down_s = [0.0] * (n + 2), [0.0] * (n + 2)
    for i in shared:
        parts = formats.staging_parts(params[i])  # master, m, v (and scales), the shadow
        stored = parts[: len(parts) - formats.shadow]
        weights = params[i] * weight_bytes if formats.shadow else 0  # the bf16 shadow comes back
        if fused:
            work = fused_bytes(parts, formats.gradient_parts(params[i])) / GPU_FUSED_BYTES_PER_S
        else:
            per_param = GPU_REFERENCE_BYTES_PER_PARAM[formats.master_dtype, formats.state_dtype]
            work = params[i] * per_param / (HBM_FRACTION * hbm_bytes_per_s)
        up_s[i] = _copy_seconds(stored, h2d) + work
        down_s[i] = _copy_seconds(stored, d2h) + weights / d2h
    return shared, up_s, down_s


def _copy_seconds(parts: Parts, pinned_bytes_per_s: float) -> float:
    """Seconds to copy `parts` one way, pinned."""
    return sum(k * d.itemsize for d, k in parts) / pinned_bytes_per_s


def share_contention(share_s: float, cpu_s: float) -> float:
    """The factor on the host AdamW's time beside a share whose copies and GPU AdamW take
    `share_s` seconds, where the host's own updates take `cpu_s` without it:
    SHARE_CPU_SLOWDOWN over the part of the CPU's time the share's copies overlap."""
    if share_s <= 0 or cpu_s <= 0:
        return 1.0
    return 1.0 + (SHARE_CPU_SLOWDOWN - 1.0) * min(1.0, share_s / cpu_s)
