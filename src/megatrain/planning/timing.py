"""Predicted step time: per-layer costs, then a replay of the engine's schedule.

Costs (T tokens per step, all supervised; F = achieved FLOP/s of the compute dtype):
- layer i forward: (2 x active params + attention) x T / F; attention per token is
  2 x context x heads x (qk_dim + v_dim), context = the mean causal span (window-capped) for
  the fused kernels, the whole row for eager attention (planning/layer_time.py);
- layer i backward: recompute forward + backward = 3 x 2 x active params + 3.5 x attention
  (flash backward is about 2.5 forwards; eager 3 x: its backward is 2 forwards), so a step is
  8 x params x T FLOPs plus attention;
- loss: 6 x V x D x T (lm_head forward + backward, never recomputed), at its own achieved
  rate (LOSS_RATE_FRACTION of the bf16 peak, at most the layers' rate: the fp32 logits'
  elementwise work weighs more than in the matmul-heavy layers);
- a forward-only pass (engine.logprobs: DPO's reference pass): the forward's loads and layer
  visits, the head's forward 2 x V x D x T, no backward, gradient copies or optimizer; its
  launches counted as the loss's (which include the backward's: an upper bound);
- a reference pass (engine.serving) adds the GPU tier's weights swap (`reference_swap_s`);
- copies: each layer goes to the GPU twice per step (forward, backward) except the
  `num_slots` last layers, which stay resident; the head (and a tied table) once. Gradients
  come back once, in the compute dtype. H2D and D2H are separate streams (full duplex);
- CPU AdamW: params / rate per block, one worker thread; the rate is the probed kernel's (the
  run's state dtype when probed so), else scaled by `state_dtype_speed`: the compressed
  kernels' ratio to fp32 grows with the host's AdamW threads (`Hardware.optimizer_threads`);
- GPU tier (the first `gpu_state_blocks` of: layers, embedding, head; engine/tier.py): no
  copies and no CPU AdamW; their AdamW runs on the compute stream at GPU_ADAMW_GPARAMS_S, right
  after the block's backward, or with clipping after the norm sync of the step's end;
- GPU update share (the last `gpu_update_blocks` streamed blocks: head, then layers from the
  last; engine/gpu_share.py): no gradient copy down and no CPU AdamW; instead their master
  and states, as stored, go up (H2D stream) and master, states and weights come back (D2H),
  one block at a time, with the AdamW on the GPU in between (the fused kernel, else the torch
  reference; its slowing of the compute beside it is not counted; planning/share_time.py); the
  host's AdamW runs slower while the share's copies use host memory (`share_contention`);
- layer GPU time (planning/layer_time.py): FLOPs at the achieved rate, memory traffic, MoE
  routing, linear attention, the gradient sum, compiled layers;
- host: issuing kernels costs `op_launch_s` per aten op; a layer's forward and its recompute
  + backward dispatch the op counts measured on meta (planning/activations.py). Small or
  MoE layers (many small kernels) become host-bound: the GPU waits for the launches.

- several ranks (planning/ranks.py): a block's copy up is the rank's shard over PCIe, then
  the all-gather of the whole block (both on the copy path, before the layer may run); its
  gradient a reduce-scatter on the compute stream, then the shard down; the embedding table is
  gathered at the forward's start; AdamW updates the shard at the node's rate over its ranks.
  A GPU-tier block is never copied nor gathered for a layer's use: its gradient is still
  reduce-scattered, its GPU AdamW updates the shard, and an all-gather of its new weights
  follows on the compute stream.
  Tokens per step (and tokens/s) are the job's: per-rank tokens x world.

The replay (planning/replay.py) runs several steps of the engine's order of operations with three
streams (compute, H2D, D2H), the host thread and the optimizer worker: slots are refilled
when the layer `num_slots` earlier is done with them, the next forward waits for each block's
update before copying it, the worker takes the landed block the next forward needs first;
without clipping updates start as gradients land, with clipping all start after the backward
(engine/engine.py). The last step's duration is the prediction. On the H200 run this gives
1.48 s (measured 1.52 s) at 8k tokens per step, where the CPU optimizer bounds the step, and
2.35 s (measured 2.21 s) at 32k, where GPU compute does; tests/planning/test_resources.py has
more (dense, MoE, fp32), tests/planning/test_memory_bound_layers.py the H100 rows of
docs/performance.md runs 32-41 (Llama-3.1-8B compiled 6.92 s predicted, 7.27 measured; the
Qwen3-30B-A3B shape cut to 12 layers 3.58 / 3.62 eager, 2.57 / 2.58 compiled; the Qwen3.5-27B
shape cut to 16 layers with torch's Gated DeltaNet 17.12 / 17.51 eager, 11.31 / 11.36
compiled), tests/planning/test_step_time_32vcpu_host.py run 43's rows on a 32-vCPU host (30
AdamW threads), compressed states: GPT-OSS-20B (eager attention, bf16 states) 11.25 / 11.77,
the Qwen3.5-27B shape (64 layers, fla, int8) 35.26 / 33.87, the Qwen3-Next-80B-A3B shape cut
to 19 layers (fla, int8) 13.48 / 13.61.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatrain.engine.plan import TierSplit
from megatrain.engine.schedule import LOAD, RECOMPUTE, StepSchedule
from megatrain.model.multimodal import patches_per_image_token, vision_numel, vision_width
from megatrain.planning.hardware import Hardware
from megatrain.planning.layer_time import (
    ATTENTION_RECOMPUTE_BACKWARD,
    attention_flops_per_token,
    layer_seconds,
)
from megatrain.planning.optimizer_rate import optimizer_gparams_s
from megatrain.planning.ranks import Ranks
from megatrain.planning.replay import Costs, Replay
from megatrain.planning.setup import Setup
from megatrain.planning.share_time import share_contention, share_seconds
from megatrain.planning.spec import FLEX_SINKS, ModelSpec
from megatrain.planning.step_bound import busy_share, step_bound

_STEPS = 4  # replayed; the first ones warm the pipeline up
COMPILED_OPS_FRACTION = 0.3
"""Host launches of a compiled layer against the eager op count (assumed: fused elementwise
chains; the matmuls and attention stay separate kernels)."""
LOSS_RATE_FRACTION = 0.43
"""Achieved share of `Hardware.gpu_tflops_bf16` by the loss (engine/head.py: the lm_head
matmuls and cross-entropy over fp32 logits, chunk by chunk), FLOPs 6 x V x D x T; its own rate,
not the layers' (which reach 0.70 at hidden 4096): the fp32 logits' elementwise work weighs
more against its single matmul. Fitted to the loss's GPU seconds in docs/performance.md run 41
(H100, 64k tokens a step): Llama-3.1-8B 0.560 s (0.468 of peak; 0.609 predicted), the
Qwen3-30B-A3B shape (hidden 2048) 0.417 s (0.372; 0.361), the Qwen3.5-27B shape (hidden 5120)
1.441 s (0.440; 1.474); the pooled FLOPs over the pooled seconds give 0.434. Capped at the
layers' rate, which is lower below hidden ~1500."""
GPU_ADAMW_GPARAMS_S = 60.0
"""Fused AdamW on the GPU (assumed, H100): ~34 bytes per parameter through HBM (read p, g, m,
v; write p, m, v; the bf16 weights cast) at ~2 TB/s achieved."""


# The vision tower's achieved rate against the engine's at the tower's width, fitted to the
# step time of docs/performance.md run 37 (Qwen2.5-VL-7B on an H100, 64 images of 448 x 448
# pixels a step: 7.94 s measured, 7.79 s predicted; the forward grew 0.70 s for 88 TFLOP: the
# tower's windows, rotary tables and merges are small kernels); one family and card measured,
# so the term is rough elsewhere.
VISION_RATE_FRACTION = 0.24


@dataclass(frozen=True)
class StepTime:
    step_s: float  # predicted wall clock of one optimizer step, steady state
    compute_s: float  # GPU busy: layer forward, recompute + backward, loss
    loss_s: float  # of which the fused loss
    h2d_s: float  # host-to-device copy stream busy (weights)
    d2h_s: float  # device-to-host copy stream busy (gradients)
    optimizer_s: float  # CPU AdamW busy time per step
    # of the step, the host waiting for updates before loading blocks (metrics.jsonl
    # time/wait_optimizer_s): with clipping every update starts after the backward
    wait_optimizer_s: float
    gpu_optimizer_s: float  # AdamW of the GPU tier on the compute stream (not in compute_s)
    collective_s: float  # all-gathers and reduce-scatters of one step (ranks; 0 alone)
    bound: str  # the resource the step waits on most
    flops: float  # hardware FLOPs per step (forward + recompute + backward + loss)
    forward_s: float  # one forward-only pass over the step's micro-batches (log-probs, no
    # gradient: the engine's forward visits and loads, the head's forward; Replay.forward_passes)
    tokens_per_s: float  # of the whole job (every rank)
    model_tflops: float  # 6 x active params x tokens/s
    vision_s: float = 0.0  # a VLM's vision modules, forward + backward (in compute_s)
    share_s: float = 0.0  # the GPU update share's copies up and down and its GPU AdamW

    @property
    def gpu_busy(self) -> float:
        """The GPU's busy share of the step: layers, loss and the tier's AdamW."""
        return busy_share(self.compute_s, self.gpu_optimizer_s, self.step_s)


def step_time(
    spec: ModelSpec,
    hw: Hardware,
    setup: Setup,
    *,
    schedule: StepSchedule,
    layer_ops: list[tuple[int, int]],
    loss_ops: int,
    layer_traffic: Sequence[tuple[int, int]] = (),
    layer_fused: Sequence[bool] = (),
    layer_scores: Sequence[tuple[int, int]] = (),
    layer_causal: Sequence[bool] = (),
) -> StepTime:
    """`schedule`: the engine's loads and layer visits (engine/schedule.py; a recompute visit
    runs a layer's forward again); `layer_ops`: per layer (forward ops, recompute + backward
    ops) of one micro-batch; `loss_ops`: ops of one micro-batch's loss (all its chunks);
    `layer_traffic`: per layer (forward, recompute + backward) bytes its ops move through GPU
    memory in one micro-batch (empty: none counted); `layer_fused`: per layer, whether a kernel
    package's call in it counts as its fused kernels; `layer_scores`: per layer, the part of
    its traffic on eager attention's [S, S] scores (planning/layer_time.py); `layer_causal`:
    per layer, its attention called causal with no mask (LayerProfile.causal_only)."""
    ranks = setup.ranks
    rows, seq, micro_batches = setup.micro_batch_size, setup.seq_len, setup.grad_accum
    costs, flops = _costs(
        spec,
        hw,
        setup,
        schedule=schedule,
        layer_ops=layer_ops,
        loss_ops=loss_ops,
        layer_traffic=layer_traffic,
        layer_fused=layer_fused,
        layer_scores=layer_scores,
        layer_causal=layer_causal,
    )
    vision_fwd, vision_bwd = _vision_s(spec, hw, setup)
    costs.fwd_s[0] += vision_fwd  # before layer 0, per micro-batch (engine/vision.py)
    costs.bwd_s[0] += vision_bwd
    replay = Replay(costs)
    step_s = replay.run(_STEPS)
    forward_s = Replay(costs).forward_passes(_STEPS)
    compute_s = sum(costs.fwd_s) + sum(costs.bwd_s) + costs.loss_s
    loads = [op.layer for op in schedule.forward + schedule.backward if op.kind == LOAD]
    h2d_s = sum(costs.h2d_s[i] for i in loads) + costs.h2d_head_s
    d2h_s = sum(costs.d2h_s) + costs.d2h_head_s + costs.d2h_embed_s
    optimizer_s = sum(costs.opt_s)
    gpu_optimizer_s = sum(costs.tier_opt_s)
    share_s = sum(costs.share_up_s) + sum(costs.share_down_s)
    others = {
        "CPU optimizer": optimizer_s,
        "PCIe (H2D)": h2d_s,
        "host (kernel launches)": sum(costs.fwd_call_s) + sum(costs.bwd_call_s),
        "GPU update share": share_s,
    }
    tokens = rows * seq * micro_batches * ranks.world
    return StepTime(
        step_s=step_s,
        compute_s=compute_s,
        loss_s=costs.loss_s,
        h2d_s=h2d_s,
        d2h_s=d2h_s,
        optimizer_s=optimizer_s,
        wait_optimizer_s=replay.waited,
        gpu_optimizer_s=gpu_optimizer_s,
        collective_s=_collectives_s(spec, ranks, costs),
        bound=step_bound(busy_share(compute_s, gpu_optimizer_s, step_s), others),
        flops=flops,
        forward_s=forward_s,
        tokens_per_s=tokens / step_s,
        model_tflops=6 * spec.active_params * tokens / step_s / 1e12,
        vision_s=vision_fwd + vision_bwd,
        share_s=share_s,
    )


def tier_params(spec: ModelSpec, gpu_state_blocks: int) -> int:
    """Parameters of the first `gpu_state_blocks` blocks in the GPU tier's order (layers from
    the first, then the embedding, then the head: engine/plan.py TierSplit)."""
    tier = TierSplit.of(spec.num_layers, gpu_state_blocks)
    params = sum(layer.params for layer in spec.layers[: tier.layers])
    return params + spec.embed_params * tier.embed + spec.head_params * tier.head


def reference_swap_s(
    spec: ModelSpec, hw: Hardware, gpu_state_blocks: int, cuda: bool, ranks: Ranks
) -> float:
    """Seconds `StreamingEngine.serving` copies a GPU tier's weights around a reference pass
    (GRPO's KL reference, dpo.reference: weights): the reference's over the host link; in fp32
    compute also the tier's own to the host and back (bf16 rebuilds them from the device's
    fp32 master: a cast, not counted). Under ranks each rank copies its shard (1/world of the
    bytes) and the weights are all-gathered twice (the reference in, the policy back).
    0 without a tier or off CUDA (the device is the host)."""
    nbytes = tier_params(spec, gpu_state_blocks) * spec.compute_dtype.itemsize * cuda
    gathers = 2 * ranks.collective_s(nbytes)
    own = nbytes / ranks.world
    up, down = own / (hw.h2d_gbps * 1e9), own / (hw.d2h_gbps * 1e9)
    return gathers + (up if spec.compute_dtype == torch.bfloat16 else 2 * up + down)


def _vision_s(spec: ModelSpec, hw: Hardware, setup: Setup) -> tuple[float, float]:
    """(forward, backward) seconds of a vision-language model's vision modules in a step: each
    image token is `patches_per_image_token` patches through the tower, 2 x its parameters in
    FLOPs each; trained (engine/vision.py), the backward runs that forward again and, for the
    tower, its backward too."""
    vision = setup.vision
    front = spec.structure.front
    if not vision.image_share or front is None:
        return 0.0, 0.0
    tokens = setup.tokens_mb * setup.grad_accum * vision.image_share
    flops = 2.0 * vision_numel(spec.structure) * tokens * patches_per_image_token(spec.config)
    rate = hw.flops_per_s(spec.compute_dtype, vision_width(spec.config)) * VISION_RATE_FRACTION
    again = 3.0 if vision.tower else 1.0 if vision.projector else 0.0
    return flops / rate, again * flops / rate


def _layer_flops(
    spec: ModelSpec, tokens: int, seq: int, causal_only: Sequence[bool] = ()
) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """Each layer's FLOPs in a step: forward, and recompute + backward (the module docstring),
    and of those the attention's where it runs on flex attention (layer_time.FLEX_SINKS).
    `causal_only`: per layer, its attention called causal with no mask (LayerProfile's)."""
    causal = list(causal_only) or [False] * spec.num_layers
    attention = [
        attention_flops_per_token(la, seq, c) for la, c in zip(spec.layers, causal, strict=True)
    ]
    backward = [ATTENTION_RECOMPUTE_BACKWARD[la.attn_implementation] for la in spec.layers]
    fwd = [
        tokens * (2.0 * la.active_params + a) for la, a in zip(spec.layers, attention, strict=True)
    ]
    bwd = [
        tokens * (6.0 * la.active_params + r * a)
        for la, a, r in zip(spec.layers, attention, backward, strict=True)
    ]
    flex = [
        (tokens * a, tokens * r * a) if la.attn_implementation == FLEX_SINKS else (0.0, 0.0)
        for la, a, r in zip(spec.layers, attention, backward, strict=True)
    ]
    return fwd, bwd, flex


def _costs(
    spec: ModelSpec,
    hw: Hardware,
    setup: Setup,
    *,
    schedule: StepSchedule,
    layer_ops: list[tuple[int, int]],
    loss_ops: int,
    layer_traffic: Sequence[tuple[int, int]],
    layer_fused: Sequence[bool],
    layer_scores: Sequence[tuple[int, int]],
    layer_causal: Sequence[bool],
) -> tuple[Costs, float]:
    """Each layer's and block's seconds on each stream and the worker for `step_time`'s replay,
    and the step's FLOPs (its arguments: `step_time`'s)."""
    plan, ranks, seq, micro_batches = setup.engine, setup.ranks, setup.seq_len, setup.grad_accum
    tier = TierSplit.of(spec.num_layers, plan.gpu_state_blocks)
    compiled = plan.compile_layers
    tokens = setup.micro_batch_size * seq * micro_batches
    launch = hw.op_launch_s * micro_batches
    rate = hw.flops_per_s(spec.compute_dtype, spec.hidden_size)
    layer_launch = launch * (COMPILED_OPS_FRACTION if compiled else 1.0)
    elem = torch.finfo(spec.compute_dtype).bits // 8  # weights up and gradients down
    fwd, bwd, flex = _layer_flops(spec, tokens, seq, layer_causal)
    fwd_s, bwd_s = layer_seconds(
        spec, hw, fwd, bwd, layer_traffic, micro_batches, compiled, layer_fused, layer_scores, flex
    )
    recomputes = [op.layer for op in schedule.backward if op.kind == RECOMPUTE]
    loss = 6.0 * spec.lm_head_params * tokens
    loss_rate = _loss_rate(spec, hw, rate)
    h2d, d2h = hw.h2d_gbps * 1e9, hw.d2h_gbps * 1e9
    opt_rate = optimizer_gparams_s(hw, setup.state_dtype) * 1e9
    n, resident = spec.num_layers, tier.layers
    # per block in forward order (embedding, layers, head): parameters the host updates
    params = spec.block_params
    on_gpu = [tier.embed, *(i < resident for i in range(n)), tier.head]
    host = [0 if gpu else p for p, gpu in zip(params, on_gpu, strict=True)]
    shard = [ranks.shard(p) for p in host]  # what this rank copies and updates
    tier_params = [p - h for p, h in zip(params, host, strict=True)]
    formats = setup.block_formats(spec.compute_dtype == torch.bfloat16)
    shared, up_s, down_s = share_seconds(
        params, host, plan.gpu_update_blocks, formats, elem, (h2d, d2h), hw.gpu_hbm_gbps * 1e9
    )
    kept = [0 if i in shared else p for i, p in enumerate(shard)]  # gradients down, CPU AdamW
    contention = share_contention(sum(up_s) + sum(down_s), sum(kept) / opt_rate)
    opt_rate /= ranks.nproc_per_node if ranks.world > 1 else 1  # the node's rate, shared

    def up(i: int) -> float:  # block i's weights: its shard over PCIe, then the all-gather
        return shard[i] * elem / h2d + ranks.collective_s(host[i] * elem)

    table = up(0) if spec.tied else 0.0  # a tied table is copied up unless in the tier
    gather_table = up(0) if ranks.world > 1 else 0.0  # the forward's rows come from it
    scatter = [ranks.collective_s(p * 4) for p in params]  # fp32 gradients, on the compute stream
    costs = Costs(
        fwd_s=[f + (gather_table if i == 0 else 0.0) for i, f in enumerate(fwd_s)],
        bwd_s=[b + scatter[1 + i] + (scatter[0] if i == 0 else 0.0) for i, b in enumerate(bwd_s)],
        loss_s=loss / loss_rate + scatter[-1],
        head_fwd_s=loss / 3.0 / loss_rate,
        h2d_s=[up(i) for i in range(1, n + 1)],
        h2d_head_s=up(n + 1) + table,
        d2h_s=[p * elem / d2h for p in kept[1:-1]],
        d2h_head_s=kept[-1] * elem / d2h,
        d2h_embed_s=shard[0] * elem / d2h,
        opt_s=[p / opt_rate * contention for p in kept],
        tier_opt_s=[_tier_update_s(p, ranks, elem) for p in tier_params],
        fwd_call_s=[f * layer_launch for f, _ in layer_ops],
        bwd_call_s=[b * layer_launch for _, b in layer_ops],
        loss_call_s=loss_ops * launch,
        schedule=schedule,
        share_up_s=up_s,
        share_down_s=down_s,
        share_sets=plan.share_sets,
        tier_embed=on_gpu[0],
        tier_head=on_gpu[-1],
        clipping=plan.clip_norm is not None,
    )
    return costs, sum(fwd) + sum(bwd) + sum(fwd[i] for i in recomputes) + loss


def _tier_update_s(params: int, ranks: Ranks, elem: int) -> float:
    """A GPU-tier block's update of `params` parameters (0: a host block): the rank's shard's
    AdamW on the GPU, then the all-gather of the block's new weights (`elem` bytes each)."""
    if not params:
        return 0.0
    return ranks.shard(params) / (GPU_ADAMW_GPARAMS_S * 1e9) + ranks.collective_s(params * elem)


def _loss_rate(spec: ModelSpec, hw: Hardware, layer_rate: float) -> float:
    """The loss's achieved FLOP/s: LOSS_RATE_FRACTION of the bf16 peak, never above the layers'
    rate (narrow models: small matmuls)."""
    if spec.compute_dtype != torch.bfloat16:  # as flops_per_s: only bf16's rate is fitted
        return layer_rate
    return min(layer_rate, hw.gpu_tflops_bf16 * 1e12 * LOSS_RATE_FRACTION)


def _collectives_s(spec: ModelSpec, ranks: Ranks, c: Costs) -> float:
    """Seconds of one step's collectives: every streamed layer gathered twice (forward,
    backward; the last slots' reuse ignored), a GPU-tier block once (after its update), the
    head and table once, a streamed embedding table once more, and every gradient
    reduce-scattered in fp32."""
    if ranks.world == 1:
        return 0.0
    elem = torch.finfo(spec.compute_dtype).bits // 8
    layers = [la.params for la in spec.layers]
    gathered = (
        2 * sum(layers[c.schedule.resident :])
        + sum(layers[: c.schedule.resident])
        + spec.head_params
    )
    gathered += spec.embed_params * (1 if c.tier_embed or not spec.tied else 2)
    scattered = sum(layers) + spec.head_params + spec.embed_params
    return ranks.collective_s(gathered * elem) + ranks.collective_s(scattered * 4)
