"""GPU seconds of a decoder layer's forward and of its recompute + backward, from the FLOPs and
memory traffic its meta profile counts (planning/activations.py); planning/timing.py builds a
step's costs from them.

- memory-bound layers: a layer's GPU time is the longer of its FLOPs at the achieved rate
  (`Hardware.flops_per_s`) and its
  memory traffic (the bytes its non-matmul aten ops read and write, counted on meta:
  planning/traffic.py) at HBM_FRACTION of the HBM bandwidth. Dense layers stay FLOP-bound (the
  fitted rate covers their elementwise work); transformers' torch fallback of
  Gated DeltaNet (`torch_chunk_gated_delta_rule`) is memory-bound: its loop over 64-token chunks
  indexes full-sequence fp32 tensors (`x[:, :, i]`), and each index's backward writes a zeroed
  tensor of the full size which autograd then adds up, chunks x sequence bytes (Qwen3.5-27B
  shape, 4 x 2048 tokens: 224 GB a forward + backward against 16 GB for a Llama-3.1-8B layer).
  With flash-linear-attention installed the GPU runs its fused kernels: the profile counts each
  call as those (planning/fused.py; 33 GB a forward + backward for that layer; the chunked
  kernel itself measured 1.69 ms forward, 3.44 ms backward at 4 x 2048 tokens on an H100), and
  such a layer takes FLOPs and traffic one after the other, as MoE layers below: beside its
  matmuls and the fused kernel it runs a chain of elementwise kernels (short convolution,
  gates, norms, casts) that the fitted rate of a dense layer does not cover. The layers'
  forward and recompute + backward come out at 8.31 s of GPU time against 8.29 s measured
  (docs/performance.md run 41; the max of the two gave 6.10 s). The torch fallback stays with
  the max, which HBM_FRACTION was fitted with (its traffic, 224 GB, dwarfs the FLOPs; the sum
  read 1.20x the eager row and 1.31x the compiled one);
- MoE layers (routed experts): FLOPs and traffic add up. The routing's index, scatter and
  elementwise kernels (half an eager layer's time) move 4x the bytes per FLOP of a dense
  layer and sit between the expert matmuls, so neither hides the other: one Qwen3-30B-A3B layer
  at 4 x 2048 tokens on an H100 (issue 24) takes 6.31 ms forward, 18.46 ms forward + backward
  eager (5.83 and 19.05 predicted; max(FLOPs, traffic) gave 3.12 and 10.74). Compiled, inductor
  fuses most of the routing: COMPILED_ROUTING_FRACTION of its traffic stays;
- gradient sum: each micro-batch's parameter gradients are added into the layer's fp32
  accumulator (engine/backward.py), 8 + 2 bytes a parameter at HBM_FRACTION, outside any
  compiled region. It scales with a layer's parameters, not its FLOPs: 4% of a Llama-3.1-8B
  layer's eager time at 4 x 2048 tokens, 14% of a Qwen3-30B-A3B layer's (11x its active
  parameters), 0.33 s of that MoE shape's 12-layer rows (2.6-3.6 s), which missed it before;
- eager attention (`LayerSpec.attn_implementation`: Gemma 2, or asked for, GPT-OSS's sinks
  included): its matmuls fill the whole [B, H, S, S] score matrix before the mask, so its FLOPs
  count the whole row (no causal half, no window) and its recompute + backward 3 forwards
  (ATTENTION_RECOMPUTE_BACKWARD); the profile counts the scale, mask, softmax and cast passes
  over the scores as traffic (planning/traffic.py `on_scores`: 23.7 GB forward and 58.0 GB
  recompute + backward of a GPT-OSS-20B layer's 33.4 and 87.2 at 4 x 2048 tokens). Compiled,
  an MoE layer takes that part at COMPILED_TRAFFIC_FRACTION, not at the routing's fraction:
  inductor fuses the chain around the scores but still reads and writes them. GPT-OSS-20B on
  an H100 (docs/performance.md run 43, compiled, 64k tokens a step): recompute + backward
  7.52 s of GPU predicted against 7.94 measured (4.91 with the scores as routing). The
  fraction is the dense layers' (run 32), not refitted: this backward alone would ask 0.67;
- attention sinks on flex attention (model/flex_sinks.py, GPT-OSS's default on CUDA,
  FLEX_SINKS): the FLOPs of the key blocks flex visits (`flex_span`: a window's blocks, the
  causal half in whole blocks), at FLEX_RATE_FRACTION of the eager rate, outside the layer's
  compiled graph;
- attention sinks on sdpa (model/sink_attention.py, at other head dims): fused kernels (no
  score traffic, recompute + backward 3.5 forwards), under a mask the whole row's FLOPs as
  eager (WHOLE_ROW), called causal with no mask (full rows' full-attention layers: the flash
  kernel) the causal half;
- compiled layers (`training.compile_layers`): layer compute runs COMPILED_SPEEDUP times faster,
  issues COMPILED_OPS_FRACTION of the eager op count and moves COMPILED_TRAFFIC_FRACTION of the
  eager traffic (inductor fuses the elementwise work around the matmuls: norms, rotary,
  activation, residuals), except layers that call a package's fused kernels, which ran slower
  compiled than eager (COMPILED_PACKAGE_SLOWDOWN);
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatrain.model.flex_sinks import BLOCK as FLEX_BLOCK
from megatrain.planning.hardware import Hardware
from megatrain.planning.spec import FLEX_SINKS, LayerSpec, ModelSpec

COMPILED_SPEEDUP = 1.2
"""Compiled layers against eager ones, GPU time of forward, recompute and backward (fitted:
Llama-3.1-8B and Qwen2.5-14B shapes on an H100, eager-fitted predictions 1.17x and 1.25x the
measured compiled steps; checked again in docs/performance.md run 13)."""
HBM_FRACTION = 0.55
"""Achieved share of `Hardware.gpu_hbm_gbps` by a memory-bound eager layer's unfused kernels
(fitted: docs/performance.md run 35, the Qwen3.5-27B shape cut to 16 layers on an H100, torch's
Gated DeltaNet fallback, 17.51 s measured, 16.84 predicted; 8.44 s when the traffic was not
counted). Strided copies, zero fills and small per-chunk kernels stay well under the datasheet.
Checked on one such layer alone (H100, issue 24, 4 x 2048 tokens, forward + backward): 0.118 s
eager (0.122 predicted), 0.063-0.078 s compiled (0.073)."""
COMPILED_TRAFFIC_FRACTION = 0.6
"""A compiled layer's memory traffic against the eager count (fitted: run 32, the same shape
with `compile_layers: true`, 11.36 s measured, 11.83 predicted)."""
COMPILED_PACKAGE_SLOWDOWN = 1.3
"""A compiled layer that calls a kernel package's fused kernels (flash-linear-attention's Gated
DeltaNet) against the same layer eager, GPU time: it ran slower compiled (why is not profiled;
the package's autograd Function and Triton autotuners are where dynamo must split the layer).
Fitted: the Qwen3.5-27B shape cut to 16 layers with fla 0.6 and `compile_layers: true`, on one
H100 of each machine (docs/performance.md run 45): the layers' forward 2.57 s and recompute +
backward 7.44 s of GPU time (10.03 predicted) against 2.26 and 6.04 eager (run 42); a step
11.54 s, 11.90 predicted. `compile_layers: auto` leaves such layers eager (planning/builder.py
COMPILE_AUTO_KINDS)."""
COMPILED_ROUTING_FRACTION = 0.2
"""A compiled MoE layer's routing traffic against the eager count (fitted: one Qwen3-30B-A3B
layer on an H100 at 8192 tokens, issue 24: forward 2.91 ms, forward + backward 8.83 ms compiled
against 2.88 and 9.08 predicted; 0.6 would give 4.1 and 13.4)."""


ATTENTION_RECOMPUTE_BACKWARD = {"sdpa": 3.5, "sinks": 3.5, FLEX_SINKS: 3.5, "eager": 3.0}
"""A layer's attention FLOPs in its recompute + backward against its forward's, by
`LayerSpec.attn_implementation`: the recompute (1) plus the backward, 2.5 forwards for the
fused kernels (flash, memory-efficient and flex recompute the scores in their backward; "sinks"
runs flash or memory-efficient), 2 for eager attention (two gradient matmuls for each of its
two matmuls; the probabilities are saved)."""
FLEX_RATE_FRACTION = (0.47, 0.40)
"""Flex attention's achieved rate against the eager layer rate (`Hardware.flops_per_s`), its
forward and its recompute + backward, on the FLOPs of the key blocks it visits (`flex_span`).
Fitted: GPT-OSS-20B's layers in `megatrain train` on an H200 (docs/performance.md run 78, 4 x
2048 tokens a micro-batch, one sliding-window and one full layer of each two): 0.41 ms forward
and 1.71 ms recompute + backward of attention kernels a layer and micro-batch, 217 and 184
TFLOP/s on 89.6 GFLOP a forward (the sliding layer's 128-token window visits 2 blocks a query
block, the full layer 8.5 on average). Alone, the kernels ran 0.29 / 1.19 ms (sliding) and
0.55 / 2.51 ms (full): the short window's blocks run at half the full layer's rate, which one
fraction averages over the model's layer mix."""
WHOLE_ROW = ("eager", "sinks")
"""`LayerSpec.attn_implementation`s whose attention computes every score of the row: eager's
matmuls, and the fused kernel under the mask that attention sinks pass (a masked
memory-efficient kernel visits every key block) unless the call is causal with no mask."""


def attention_flops_per_token(layer: LayerSpec, seq: int, causal_only: bool = False) -> float:
    """Forward FLOPs of softmax attention for one token: averaged over causal positions (the
    window-capped span) where the fused kernels skip the masked blocks, over the whole row
    (WHOLE_ROW) for eager attention, whose matmuls fill the [S, S] score matrix before the mask,
    and for attention sinks' masked kernel (no causal half, no window saving), unless the
    layer's attention was called causal with no mask (`causal_only`: LayerProfile's; sinks
    then run the flash kernel, model/sink_attention.py)."""
    if layer.attn_heads == 0:
        return 0.0
    w = layer.window
    if layer.attn_implementation == FLEX_SINKS:
        return 2.0 * flex_span(seq, w) * layer.attn_heads * (layer.attn_qk_dim + layer.attn_v_dim)
    whole = layer.attn_implementation in WHOLE_ROW
    if whole and not (causal_only and layer.attn_implementation == "sinks"):
        span: float = seq
    elif w is None or seq <= w:
        span = (seq + 1) / 2
    else:
        span = (w * (w + 1) / 2 + (seq - w) * w) / seq
    return 2.0 * span * layer.attn_heads * (layer.attn_qk_dim + layer.attn_v_dim)


def flex_span(seq: int, window: int | None) -> float:
    """Keys a query's score row computes on flex attention, averaged over the row's queries:
    each query block (FLEX_BLOCK queries) computes whole key blocks, every block from the one
    holding its first query's first key in the window (the causal start without one) to its
    own."""
    total = 0.0
    for first in range(0, seq, FLEX_BLOCK):
        start = 0 if window is None else max(0, first - window + 1)
        blocks = first // FLEX_BLOCK - start // FLEX_BLOCK + 1
        total += min(FLEX_BLOCK, seq - first) * min(blocks * FLEX_BLOCK, seq)
    return total / seq


def layer_seconds(
    spec: ModelSpec,
    hw: Hardware,
    fwd: list[float],
    bwd: list[float],
    traffic: Sequence[tuple[int, int]],
    micro_batches: int,
    compiled: bool,
    fused: Sequence[bool] = (),
    scores: Sequence[tuple[int, int]] = (),
    flex: Sequence[tuple[float, float]] = (),
) -> tuple[list[float], list[float]]:
    """GPU seconds of each layer's forward and recompute + backward (all micro-batches): its
    FLOPs at the achieved rate, or its memory traffic at HBM_FRACTION of the HBM bandwidth where
    that takes longer (a memory-bound layer; the achieved rate covers a matmul-bound layer's
    elementwise work, fitted so); a layer with routed experts, or whose kernel package call
    counts as fused kernels (`fused`), takes both, one after the other (experts compiled:
    COMPILED_ROUTING_FRACTION of the traffic, except the part of it on eager attention's
    [S, S] scores, `scores`: COMPILED_TRAFFIC_FRACTION as in any compiled layer). Compiled:
    COMPILED_SPEEDUP faster, COMPILED_TRAFFIC_FRACTION of the traffic; a layer with a package's
    fused kernels COMPILED_PACKAGE_SLOWDOWN slower than eager. The backward adds the gradient
    sum. `flex`: per layer, the FLOPs of `fwd` and `bwd` that flex attention computes (at
    FLEX_RATE_FRACTION of the eager rate, compiled or not: it runs outside the layer's graph)."""
    eager_rate = hw.flops_per_s(spec.compute_dtype, spec.hidden_size)
    rate = eager_rate * (COMPILED_SPEEDUP if compiled else 1.0)
    hbm = hw.gpu_hbm_gbps * 1e9 * HBM_FRACTION / micro_batches  # traffic is per micro-batch
    share = COMPILED_TRAFFIC_FRACTION if compiled else 1.0
    routing = COMPILED_ROUTING_FRACTION if compiled else 1.0
    moved = list(traffic) or [(0, 0)] * len(fwd)
    serial = list(fused) or [False] * len(fwd)
    on_scores = list(scores) or [(0, 0)] * len(fwd)

    def seconds(flops: float, nbytes: int, on_s: int, layer: LayerSpec, kernels: bool) -> float:
        if layer.active_params < layer.params:  # routed experts (spec.py)
            return flops / rate + ((nbytes - on_s) * routing + on_s * share) / hbm
        if kernels and compiled:  # split at the package's calls: slower than eager
            return (flops / eager_rate + nbytes / hbm) * COMPILED_PACKAGE_SLOWDOWN
        if kernels:  # a package's fused kernels and the elementwise work around them
            return flops / rate + nbytes * share / hbm
        return max(flops / rate, nbytes * share / hbm)

    on_flex = list(flex) or [(0.0, 0.0)] * len(fwd)
    forward_rate, backward_rate = (eager_rate * f for f in FLEX_RATE_FRACTION)
    layers = list(zip(spec.layers, serial, on_flex, strict=True))
    fwd_s = [
        seconds(f - a, m, s, la, k) + a / forward_rate
        for f, (m, _), (s, _), (la, k, (a, _)) in zip(fwd, moved, on_scores, layers, strict=True)
    ]
    bwd_s = [
        seconds(b - a, m, s, la, k)
        + a / backward_rate
        + gradient_sum_s(la, spec.compute_dtype, hw) * micro_batches
        for b, (_, m), (_, s), (la, k, (_, a)) in zip(bwd, moved, on_scores, layers, strict=True)
    ]
    return fwd_s, bwd_s


def gradient_sum_s(layer: LayerSpec, compute_dtype: torch.dtype, hw: Hardware) -> float:
    """GPU seconds of adding one micro-batch's parameter gradients of `layer` into its fp32
    accumulator (engine/backward.py, outside any compiled region): the gradient and the sum read,
    the sum written, at HBM_FRACTION of the HBM bandwidth."""
    nbytes = layer.params * (2 * 4 + compute_dtype.itemsize)
    return nbytes / (hw.gpu_hbm_gbps * 1e9 * HBM_FRACTION)
