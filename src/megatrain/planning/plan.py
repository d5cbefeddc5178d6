"""A run's resolved plan: batch choice, estimate, fit check and the EnginePlan, from one input.

    shape = RunShape.of(cfg, placement, layout=None, compiled=False, pin_memory=True)
    plan = resolve(cfg, spec, hardware, shape)   # pure; plan.engine is what the engine runs
    plan.require_fit()          # ValueError naming what does not fit and what to change

Invariant: the automatic micro-batch is chosen against exactly the estimate that the fit check
then judges (same shape, same loss chunk, same pinning), so "auto" never picks a batch the check
refuses for a reason it did not see; the engine runs the EnginePlan that estimate measured.
`megatrain estimate` and `megatrain train` both read the plan from planning/builder.py. The
GPU tier (engine/tier.py) is chosen after the batch: "auto" (`memory.gpu_state_blocks`) gives
it the most blocks (engine/plan.py `tier_order`) whose predicted GPU peak (the allocator's
reserved peak, planning/allocator_slack.py) still fits with `gpu_margin_gib` free; on the CPU
"auto" is 0; a given count is clamped to the model's blocks. Then the GPU update share
(engine/gpu_share.py, `optimizer.gpu_update_blocks`): "auto" the count of the shortest
predicted step that fits (planning/gpu_share.py); 0 on the CPU and under ranks.
Several ranks (`RunShape.ranks`): the estimate is per rank on the GPU and per node on the host
(a node that cannot hold its ranks' shards is refused before loading); the tier is picked
against one rank's GPU (states sharded, weights whole: planning/estimate.py).
Long rows: where the layer inputs wait (GPU, host, or recomputed every K layers) is chosen
first, with the MLPs over the most sequence tiles `memory.mlp_tiles: auto` allows (the least
memory); then, on the GPU, "auto" keeps the fewest tiles (1, 2, 4, ...) whose predicted peak
still fits: tiles cost about 10% of an 8B step at 128k tokens on an H100 (engine/tiling.py,
docs/performance.md run 24), so they are paid only where memory needs them.
Later plans extend `RunShape` and `ResourcePlan`, not their callers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatrain.config import TrainConfig
from megatrain.distributed import Placement, rows_per_rank
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.gpu_share import share_size
from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.plan import EnginePlan, TierSplit, tier_size
from megatrain.engine.tiling import TilePolicy, tileable, untiled_layers
from megatrain.layouts import LAYOUTS
from megatrain.planning.batch_size import pick_micro_batch
from megatrain.planning.estimate import Estimate, estimate
from megatrain.planning.fit import gpu_problem, host_problem
from megatrain.planning.gpu_share import pick_share
from megatrain.planning.hardware import GIB, Hardware, gib
from megatrain.planning.host_memory import pinned_reserved
from megatrain.planning.long_context import choose_boundaries
from megatrain.planning.ranks import ONE_PROCESS, Ranks
from megatrain.planning.resource_plan import ResourcePlan
from megatrain.planning.setup import NO_VISION, Setup, VisionLoad
from megatrain.planning.spec import ModelSpec


@dataclass(frozen=True)
class RunShape:
    """The run's fixed settings as configured ("auto" where the plan decides)."""

    seq_len: int
    num_slots: int
    layout: str  # "padded" rows (masks), "packed" samples, or "full" rows without mask
    clip_norm: float | None  # gradient-norm clipping; None: off
    loss_chunk_tokens: int | None  # None: the head's default for the vocabulary
    pin_memory: bool
    check_gpu: bool  # a CUDA run: the GPU peak must fit too
    state_dtype: str  # AdamW m and v on the host: choices.py STATE_DTYPES (host memory)
    gpu_state_blocks: int | str = 0  # GPU-tier blocks, or "auto" (resolved by the plan)
    compiled: bool = False  # decoder layers torch.compile'd (training.compile_layers)
    activation_offload: str = "off"  # layer inputs to the host: "auto", "on" or "off"
    checkpoint_every: int | str = 1  # one layer input kept every K layers, or "auto"
    mlp_tiles: int | str = 1  # sequence tiles of the MLPs, or "auto" (engine/tiling.py)
    ranks: Ranks = ONE_PROCESS  # processes of the job (torchrun); the batch is per rank
    rank: int = 0  # this process's rank
    vision: VisionLoad = NO_VISION  # a vision-language run's (planning/setup.py)
    master_dtype: str = "fp32"  # master weights on the host: "fp32" or "bf16" (host memory)
    grad_dtype: str = "bf16"  # a bf16 master's held gradients: "bf16" or "int8" (store/grads.py)
    rows_multiple: int = 1  # "auto" micro-batches hold a multiple of it (a preference pair: 2)
    gpu_update_blocks: int | str = 0  # streamed blocks updated on the GPU, or "auto"

    def __post_init__(self) -> None:
        if (
            isinstance(self.gpu_update_blocks, int)
            and self.gpu_update_blocks
            and self.ranks.world > 1
        ):
            raise ValueError(
                f"optimizer.gpu_update_blocks={self.gpu_update_blocks} under {self.ranks.world} "
                "ranks: the GPU update share runs in one process only (each rank would have to "
                "update its shard of the blocks on its GPU, which is not built yet); set "
                "optimizer.gpu_update_blocks: 0, or train in one process"
            )

    @classmethod
    def of(
        cls,
        cfg: TrainConfig,
        placement: Placement,
        *,
        layout: str | None,
        compiled: bool,
        pin_memory: bool,
        images: float = 0.0,
    ) -> RunShape:
        """The run's settings as its config gives them (`layout`: a what-if, else the run's;
        `compiled`: training.compile_layers resolved, planning/builder.py; `images`: the
        data's share of image tokens)."""
        mem, p = cfg.memory, placement
        return cls(
            seq_len=cfg.seq_len,
            num_slots=mem.num_slots,
            layout=layout or cfg.layout,
            clip_norm=cfg.optimizer.clip_norm,
            loss_chunk_tokens=mem.loss_chunk_tokens,
            pin_memory=pin_memory,
            check_gpu=p.is_cuda,
            state_dtype=cfg.optimizer.state_dtype,
            master_dtype=cfg.optimizer.master_dtype,
            grad_dtype=cfg.optimizer.grad_dtype,
            gpu_state_blocks=mem.gpu_state_blocks,
            compiled=compiled,
            activation_offload=mem.activation_offload,
            checkpoint_every=mem.checkpoint_every,
            mlp_tiles=mem.mlp_tiles,
            ranks=Ranks(p.local_world_size, p.world_size // p.local_world_size),
            rank=p.rank,
            vision=VisionLoad(not cfg.model.freeze_vision, not cfg.model.freeze_projector, images),
            rows_multiple=cfg.rows_together,
            gpu_update_blocks=cfg.optimizer.gpu_update_blocks,
        )

    def tile_policy(self, spec: ModelSpec, count: int | None = None) -> TilePolicy | None:
        """The engine's tiling: none where layers draw random numbers (engine/tiling.py); for
        "auto" on the GPU `count` tiles at seq_len (shorter rows in proportion), else the
        setting's policy."""
        if not tileable(spec.structure):
            return None
        auto_here = self.mlp_tiles == "auto" and self.check_gpu and not self.compiled
        if auto_here and count is not None:
            return TilePolicy(None, tile_tokens=math.ceil(self.seq_len / count))
        return TilePolicy.from_setting(self.mlp_tiles, self.compiled)

    def most_tiles(self, spec: ModelSpec) -> int:
        """The setting's tile count at seq_len (for "auto", the most it allows)."""
        policy = self.tile_policy(spec)
        return 1 if policy is None else policy.count(self.seq_len)

    def engine_plan(
        self,
        spec: ModelSpec,
        tier: int,
        boundaries: BoundaryPlan | None,
        tiles: int | None,
        share: int = 0,
    ) -> EnginePlan:
        """The engine's plan with `tier` blocks, `boundaries`, `tiles` (a count for "auto") and
        `share` blocks updated on the GPU."""
        policy = self.tile_policy(spec, tiles)
        return EnginePlan(
            num_slots=self.num_slots,
            clip_norm=self.clip_norm,
            loss_chunk_tokens=self.loss_chunk_tokens or default_chunk_tokens(spec.vocab_size),
            compile_layers=self.compiled,
            gpu_state_blocks=min(tier, tier_size(spec.num_layers)),
            boundaries=boundaries,
            tiles=policy,
            untiled=untiled_layers(spec.structure) if policy is not None else frozenset(),
            world_size=self.ranks.world,
            rank=self.rank,
            train_vision=self.vision.tower,
            train_projector=self.vision.projector,
            gpu_update_blocks=share,
        )

    def setup(self, engine: EnginePlan, micro_batch_size: int, grad_accum: int) -> Setup:
        assert self.layout in LAYOUTS, self.layout
        return Setup(
            engine,
            seq_len=self.seq_len,
            micro_batch_size=micro_batch_size,
            grad_accum=grad_accum,
            layout=self.layout,
            state_dtype=self.state_dtype,
            master_dtype=self.master_dtype,
            grad_dtype=self.grad_dtype,
            pin_memory=self.pin_memory,
            ranks=self.ranks,
            vision=self.vision,
            cuda=self.check_gpu,
        )


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
    reason = None
    gpu_margin_gib = shape.ranks.gpu_margin_gib(gpu_margin_gib)  # NCCL's buffers under ranks
    most_tiles = shape.most_tiles(spec)
    if micro_batch_size == "auto":
        target: dict[str, Any] = (
            {"tokens_per_step": tokens_per_step}
            if tokens_per_step is not None
            else {"grad_accum": grad_accum}
        )
        template = shape.setup(shape.engine_plan(spec, 0, None, most_tiles), 1, 1)
        micro_batch_size, grad_accum, reason = pick_micro_batch(
            spec,
            template,
            hardware=hardware,
            gpu_margin_gib=gpu_margin_gib,
            on_host=not shape.check_gpu,  # a CPU run: its step's buffers are host memory
            host_margin_gib=host_margin_gib,
            rows_multiple=shape.rows_multiple,
            **target,
        )
    elif tokens_per_step is not None:
        grad_accum = _grad_accum_for(tokens_per_step, int(micro_batch_size), shape.seq_len)
    assert isinstance(micro_batch_size, int)

    def predict(
        tier: int, boundaries: BoundaryPlan | None = None, tiles: int = most_tiles, share: int = 0
    ) -> Estimate:
        engine = shape.engine_plan(spec, tier, boundaries, tiles, share)
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

    tier, tier_reason = _tier(shape, spec, predict, hardware, gpu_margin_gib, gpu_reserve_bytes)
    share, share_reason = pick_share(
        shape.gpu_update_blocks,
        functools.partial(predict, tier),
        share_size(
            spec.num_layers, TierSplit.of(spec.num_layers, tier), tier_size(spec.num_layers)
        ),
        hardware.gpu_bytes - gpu_margin_gib * GIB - gpu_reserve_bytes,
        why_none="no GPU" if not shape.check_gpu else "ranks" if shape.ranks.world > 1 else None,
    )
    engine = shape.engine_plan(spec, tier, boundaries, tiles, share)
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
        share_reason=share_reason,
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


def tier_refusal(state_dtype: str, master_dtype: str) -> str | None:
    """Why the GPU tier takes no block of this store (None: it may): it keeps fp32 states and
    an fp32 master (config/sections.py refuses a tier given with others)."""
    if state_dtype != "fp32":
        return f"state_dtype {state_dtype}: fp32 only"
    if master_dtype != "fp32":
        return f"master_dtype {master_dtype}: fp32 only"
    return None


def _tier(
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
    return _pick_tier(predict, blocks, shape.check_gpu, hardware, gpu_margin_gib, reserve)


def _pick_tier(
    predict: Callable[[int], Estimate],
    num_blocks: int,
    on_gpu: bool,
    hardware: Hardware,
    gpu_margin_gib: float,
    reserve: int = 0,
) -> tuple[int, str]:
    """The most blocks (tier order) whose GPU-tier states fit beside the run, and beside
    `reserve` bytes next to the persistent buffers, and why.

    The predicted peak grows with the count (each block adds 8-18 B/param and frees at most
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


def _grad_accum_for(tokens_per_step: int, micro_batch_size: int, seq_len: int) -> int:
    rows = tokens_per_step // seq_len
    if rows < micro_batch_size or rows % micro_batch_size or rows * seq_len != tokens_per_step:
        raise ValueError(
            f"tokens per step {tokens_per_step} must be a multiple of micro_batch_size x "
            f"seq_len = {micro_batch_size * seq_len}"
        )
    return rows // micro_batch_size
