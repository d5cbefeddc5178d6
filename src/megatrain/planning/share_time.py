"""The GPU update share's seconds in the step-time model (planning/timing.py).

The share (engine/gpu_share.py: the last `gpu_update_blocks` streamed blocks, head, then
layers from the last) skips a block's gradient copy down and its CPU AdamW; instead its master
and states, as stored, go up (H2D stream) and master, states and weights come back (D2H), one
block at a time, with the torch reference AdamW on the GPU in between. The store keeps master
and states pageable, so they cross the link at PAGEABLE_COPY_BYTES_PER_S; the AdamW moves
GPU_REFERENCE_BYTES_PER_PARAM through GPU memory at GPU_UNFUSED_BYTES_PER_S (its slowing of
the compute beside it is not counted). planning/gpu_share.py picks the count for "auto".
"""

from __future__ import annotations

from megatrain.engine.gpu_share import BlockFormats, share_of

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
PAGEABLE_COPY_BYTES_PER_S = 10e9
"""Host link rate of a copy from or to pageable host memory (the GPU update share's master and
states: the store keeps them pageable; CUDA bounces them through its own pinned buffer). Fitted
to docs/performance.md run 58 (one H100, 128 GiB host): the share of 2 blocks (0.91B
parameters, fp32 master and int8 states, 12.8 GB up and down) took 1.68 s where the pinned
rate predicted 0.70 s; with 0.43 s of GPU AdamW that leaves 1.25 s for the copies."""
GPU_UNFUSED_BYTES_PER_S = 1.06e12
"""What unfused elementwise kernels achieve of an H100's memory bandwidth (assumed, as
docs/optimizer_states.md "Which tier" did: 0.29 s for the 374 B/param of a 0.82B int8 block),
so the share's AdamW runs at GPU_UNFUSED_BYTES_PER_S / GPU_REFERENCE_BYTES_PER_PARAM: 3.9
Gparams/s for fp32 states, 0.6 for a bf16 master (measure: docs/performance.md)."""


def share_seconds(
    params: list[int],
    host: list[int],
    share: int,
    formats: BlockFormats,
    weight_bytes: int,
    d2h_bytes_per_s: float,
) -> tuple[set[int], list[float], list[float]]:
    """The share's blocks by forward position (embedding 0, layers, head last) and each block's
    seconds up (master and states, then its GPU AdamW) and down (master, states and a bf16
    shadow's weights); 0 for a block outside the share. `params`: every block's parameters;
    `host`: of them, those the host updates (0: a GPU-tier block, never shared); `share`: the
    share's block count; `weight_bytes`: bytes of one weight in the compute dtype."""
    n = len(params) - 2
    shared = set(share_of(list(range(1, n + 1)), n + 1, lambda i: host[i] > 0, share))
    up_s, down_s = [0.0] * (n + 2), [0.0] * (n + 2)
    for i in shared:
        parts = formats.staging_parts(params[i])  # master, m, v (and scales), the shadow
        stored = sum(k * d.itemsize for d, k in parts[: len(parts) - formats.shadow])
        weights = params[i] * weight_bytes if formats.shadow else 0  # the bf16 shadow comes back
        work = GPU_REFERENCE_BYTES_PER_PARAM[formats.master_dtype, formats.state_dtype]
        up_s[i] = stored / PAGEABLE_COPY_BYTES_PER_S + params[i] * work / GPU_UNFUSED_BYTES_PER_S
        down_s[i] = stored / PAGEABLE_COPY_BYTES_PER_S + weights / d2h_bytes_per_s
    return shared, up_s, down_s
