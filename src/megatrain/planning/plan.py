"""A run's resolved plan: batch choice, estimate, fit check and the EnginePlan, from one input.

    shape = RunShape.of(cfg, placement, layout=None, compiled=False, pin_memory=True)
    plan = resolve(cfg, spec, hardware, shape)   # pure; plan.engine is what the engine runs
    plan.require_fit()          # ValueError naming what does not fit and what to change

Invariant: the automatic micro-batch is chosen against exactly the estimate that the fit check
then judges (same shape, same loss chunk, same pinning), so "auto" never picks a batch the check
refuses for a reason it did not see; the engine runs the EnginePlan that estimate measured.
`megatrain estimate` and `megatrain train` both read the plan from planning/builder.py. The
GPU tier (engine/tier.py) is chosen after the batch: "auto" (`memory.gpu_state_blocks`) gives
it the most blocks whose predicted GPU peak still fits with `gpu_margin_gib` free
(planning/gpu_tier.py); on the CPU "auto" is 0. Then the GPU update share
(engine/gpu_share.py, `optimizer.gpu_update_blocks`, on `optimizer.gpu_update_sets` staging
sets): "auto" the count and sets of the shortest predicted step that fits
(planning/gpu_share.py); 0 on the CPU and under ranks.
Several ranks (`RunShape.ranks`): the estimate is per rank on the GPU and per node on the host
(a node that cannot hold its ranks' shards is refused before loading); the tier is picked
against one rank's GPU (states sharded, weights whole: planning/estimate.py).
Long rows: where the layer inputs wait (GPU, host, or recomputed every K layers) is chosen
first, with the MLPs over the most sequence tiles `memory.mlp_tiles: auto` allows (the least
memory); then, on the GPU, "auto" keeps the fewest tiles (1, 2, 4, ...) whose predicted peak
still fits: tiles cost about 10% of an 8B step at 128k tokens on an H100 (engine/tiling.py,
docs/performance.md run 24), so they are paid only where memory needs them.
Later plans extend `RunShape` (planning/run_shape.py) and `ResourcePlan`, not their callers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from megatrain.config import TrainConfig
from megatrain.distributed import rows_per_rank
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.gpu_share import share_size
from megatrain.engine.plan import TierSplit, tier_size
from megatrain.planning.batch_size import pick_micro_batch
from megatrain.planning.estimate import Estimate, estimate
from megatrain.planning.fit import gpu_problem, host_problem
from megatrain.planning.gpu_share import ShareChoice, pick_share, trade_tier
from megatrain.planning.gpu_tier import pick_tier
from megatrain.planning.hardware import GIB, Hardware
from megatrain.planning.host_memory import pinned_reserved
from megatrain.planning.long_context import choose_boundaries
from megatrain.planning.resource_plan import ResourcePlan
from megatrain.planning.run_shape import RunShape
from megatrain.planning.spec import ModelSpec


def resolve(
    cfg: TrainConfig,
    spec: ModelSpec,
    hardware: Hardware,
    shape: RunShape,
    *,
    tokens_per_step: int | None = None,
    gpu_reserve_bytes: int = 0,
) -> ResourcePlan:
    """The run's plan from its config (pure: no process group, nothing allocated): the batch
    of training.micro_batch_size / gradient_accumulation_steps / global_batch_size (per rank),
    every "auto" memory setting resolved, the fit judged with memory's margins; its `engine`
    is the EnginePlan the engine runs. `shape`: `RunShape.of(cfg, placement, ...)`."""
    t, mem = cfg.training, cfg.memory
    if tokens_per_step is None and t.global_batch_size and t.micro_batch_size == "auto":
        tokens_per_step = rows_per_rank(t.global_batch_size, shape.ranks.world) * cfg.seq_len
    return plan_resources(
        spec,
        shape,
        hardware=hardware,
        micro_batch_size=t.micro_batch_size,
        grad_accum=t.gradient_accumulation_steps,
        tokens_per_step=tokens_per_step,
        gpu_margin_gib=mem.gpu_margin_gib,
        host_margin_gib=mem.host_margin_gib,
        gpu_reserve_bytes=gpu_reserve_bytes,
    )


def plan_resources(
    spec: ModelSpec,
    shape: RunShape,
    *,
    hardware: Hardware,
    micro_batch_size: int | str,
    grad_accum: int = 1,
    tokens_per_step: int | None = None,
    gpu_margin_gib: float,
    host_margin_gib: float,
    gpu_reserve_bytes: int = 0,
) -> ResourcePlan:
    """Resolve the batch ("auto" or given) and predict the run.

    `gpu_reserve_bytes`: GPU memory another phase of the run needs beside the engine's
    persistent buffers (GRPO's resident rollout); the automatic GPU tier leaves it free.

    `tokens_per_step` (optional) fixes the step's tokens: with "auto" the accumulation follows
    the chosen micro-batch; with a given micro-batch it must divide the step's rows.
    """
    gpu_margin_gib = shape.ranks.gpu_margin_gib(gpu_margin_gib)  # NCCL's buffers under ranks
    most_tiles = shape.most_tiles(spec)
    micro_batch_size, grad_accum, reason = _batch(
        spec,
        shape,
        hardware,
        micro_batch_size,
        grad_accum,
        tokens_per_step,
        gpu_margin_gib,
        host_margin_gib,
    )

    def predict(
        tier: int,
        boundaries: BoundaryPlan | None = None,
        tiles: int = most_tiles,
        share: int = 0,
        sets: int = 1,
    ) -> Estimate:
        engine = shape.engine_plan(spec, tier, boundaries, tiles, share, sets)
        return estimate(spec, shape.setup(engine, micro_batch_size, grad_accum), hardware)

    boundaries, boundary_reason = _pick_boundaries(
        spec, shape, predict(0), hardware, gpu_margin_gib, host_margin_gib
    )
    tiles, tiles_reason = most_tiles, None
    if shape.mlp_tiles == "auto" and shape.check_gpu and tiles > 1:
        budget = hardware.gpu_bytes - gpu_margin_gib * GIB
        tiles, tiles_reason = _pick_tiles(
            lambda n: predict(0, boundaries, n).gpu.peak_bytes, tiles, budget, shape.seq_len
        )
    predict = functools.partial(predict, boundaries=boundaries, tiles=tiles)

    tier, tier_reason, share = _tier_and_share(
        shape, spec, predict, hardware, (gpu_margin_gib, host_margin_gib), gpu_reserve_bytes
    )
    engine = shape.engine_plan(spec, tier, boundaries, tiles, share.blocks, share.sets)
    setup = shape.setup(engine, micro_batch_size, grad_accum)
    est = estimate(spec, setup, hardware)
    problems = [host_problem(est, hardware, host_margin_gib)]
    if shape.check_gpu:
        problems.append(gpu_problem(est, hardware, gpu_margin_gib))
    return ResourcePlan(
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        estimate=est,
        engine=engine,
        batch_reason=reason,
        problems=tuple(p for p in problems if p),
        setup=setup,
        tier_reason=tier_reason,
        boundary_reason=boundary_reason,
        mlp_tiles=tiles,
        tiles_reason=tiles_reason,
        share_reason=share.reason,
    )


def _batch(
    spec: ModelSpec,
    shape: RunShape,
    hardware: Hardware,
    micro_batch_size: int | str,
    grad_accum: int,
    tokens_per_step: int | None,
    gpu_margin_gib: float,
    host_margin_gib: float,
) -> tuple[int, int, str | None]:
    """(micro-batch, accumulation, why "auto" chose them: None where given): "auto" picked
    against the estimate with the most MLP tiles, no GPU tier and every layer input on the GPU
    (planning/batch_size.py); where none fits so and the inputs may go to the host
    (memory.activation_offload not "off"), against the estimate with every input on the host
    (`_pick_boundaries` then keeps on the GPU what fits beside the chosen micro-batch). A
    given micro-batch takes the accumulation `tokens_per_step` asks for, if any."""
    if micro_batch_size == "auto":
        target: dict[str, Any] = (
            {"tokens_per_step": tokens_per_step}
            if tokens_per_step is not None
            else {"grad_accum": grad_accum}
        )

        def pick(boundaries: BoundaryPlan | None) -> tuple[int, int, str]:
            engine = shape.engine_plan(spec, 0, boundaries, shape.most_tiles(spec))
            return pick_micro_batch(
                spec,
                shape.setup(engine, 1, 1),
                hardware=hardware,
                gpu_margin_gib=gpu_margin_gib,
                on_host=not shape.check_gpu,  # a CPU run: its step's buffers are host memory
                host_margin_gib=host_margin_gib,
                rows_multiple=shape.rows_multiple,
                **target,
            )

        try:
            return pick(None)
        except ValueError:
            if not shape.check_gpu or shape.activation_offload == "off":
                raise
            n = spec.num_layers
            b, ga, reason = pick(BoundaryPlan.make(n, on_host=n))
            return b, ga, f"{reason} (with the layer inputs on the host where the GPU lacks room)"
    if tokens_per_step is not None:
        grad_accum = _grad_accum_for(tokens_per_step, int(micro_batch_size), shape.seq_len)
    assert isinstance(micro_batch_size, int)
    return micro_batch_size, grad_accum, None


def _tier_and_share(
    shape: RunShape,
    spec: ModelSpec,
    predict: Callable[..., Estimate],
    hardware: Hardware,
    margins_gib: tuple[float, float],
    reserve: int,
) -> tuple[int, str | None, ShareChoice]:
    """(tier, why, share): the share beside the most tier blocks that fit beside `reserve`
    bytes and the GPU margin (of `margins_gib`: GPU, host), and where both are "auto", fewer
    tier blocks where that predicts a shorter step and the host holds what they leave there:
    their room holds a larger share, or the host updates them (planning/gpu_share.py
    `trade_tier`)."""
    gpu_margin_gib, host_margin_gib = margins_gib
    tier, tier_reason = pick_tier(shape, spec, predict, hardware, gpu_margin_gib, reserve)
    budget = hardware.gpu_bytes - gpu_margin_gib * GIB - reserve

    def pick(t: int) -> ShareChoice:
        return _share(shape, spec, functools.partial(predict, t), t, budget)

    def host_fits(t: int) -> bool:
        return host_problem(predict(t), hardware, host_margin_gib) is None

    if shape.gpu_state_blocks != "auto" or shape.gpu_update_blocks != "auto" or not tier:
        return tier, tier_reason, pick(tier)
    traded = trade_tier(tier, pick, host_fits)
    if traded.traded:
        tier_reason = traded.tier_reason(tier_size(spec.num_layers), reserve)
    return traded.tier, tier_reason, traded.share


def _share(
    shape: RunShape, spec: ModelSpec, predict: Callable[..., Estimate], tier: int, budget: float
) -> ShareChoice:
    """The GPU update share's block count and staging sets beside `tier` GPU-tier blocks, its
    peak within `budget` GPU bytes (planning/gpu_share.py), and why "auto" chose them.
    `predict(share=n, sets=s)`: the run's estimate with n share blocks on s staging sets."""
    n = spec.num_layers
    return pick_share(
        shape.gpu_update_blocks,
        shape.gpu_update_sets,
        predict,
        share_size(n, TierSplit.of(n, tier), tier_size(n)),
        budget,
        why_none="no GPU" if not shape.check_gpu else "ranks" if shape.ranks.world > 1 else None,
    )


def _pick_tiles(
    peak: Callable[[int], int], most: int, budget: float, seq_len: int
) -> tuple[int, str]:
    """The fewest MLP tiles (1, 2, 4, ..., `most`) whose predicted GPU peak fits `budget`."""
    counts = sorted({1 << k for k in range(most.bit_length()) if 1 << k < most} | {most})
    n = next((c for c in counts if peak(c) <= budget), most)
    return n, (
        f"MLP tiles: {n} of up to {most} at {seq_len} tokens "
        + ("(the untiled layer fits)" if n == 1 else "(the fewest whose peak fits)")
    )


def _pick_boundaries(
    spec: ModelSpec,
    shape: RunShape,
    on_device: Estimate,
    hardware: Hardware,
    gpu_margin_gib: float,
    host_margin_gib: float,
) -> tuple[BoundaryPlan, str]:
    """Where the layer inputs wait: the room `on_device` (every input on the GPU) leaves
    beside everything else, GPU first, host second (planning/long_context.py)."""
    s = on_device.settings
    input_bytes = s["micro_batch_size"] * shape.seq_len * spec.hidden_size
    input_bytes *= spec.compute_dtype.itemsize
    inputs = on_device.gpu.items.get("boundary activations", 0)
    gpu_free = (
        hardware.gpu_bytes - gpu_margin_gib * GIB - (on_device.gpu.peak_bytes - inputs)
        if shape.check_gpu
        else math.inf  # on the CPU the device is the host: inputs kept there cost the same
    )
    host_free = hardware.host_bytes - host_margin_gib * GIB - on_device.host.total_bytes
    offload, every = shape.activation_offload, shape.checkpoint_every
    if not shape.check_gpu:  # "auto" on the CPU: keep every input (as the builder does)
        offload = "off" if offload == "auto" else offload
        every = 1 if every == "auto" else every
    return choose_boundaries(
        spec.num_layers,
        input_bytes=input_bytes,
        micro_batches=s["grad_accum"],
        gpu_free_bytes=gpu_free,
        host_free_bytes=host_free,
        offload=offload,
        every=every,
        reserved=pinned_reserved if shape.pin_memory else (lambda n: n),
    )


def _grad_accum_for(tokens_per_step: int, micro_batch_size: int, seq_len: int) -> int:
    rows = tokens_per_step // seq_len
    if rows < micro_batch_size or rows % micro_batch_size or rows * seq_len != tokens_per_step:
        raise ValueError(
            f"tokens per step {tokens_per_step} must be a multiple of micro_batch_size x "
            f"seq_len = {micro_batch_size * seq_len}"
        )
    return rows // micro_batch_size
