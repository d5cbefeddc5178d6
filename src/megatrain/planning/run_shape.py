"""A run's settings as its config gives them ("auto" where the plan decides), and the engine's
plan and the estimate's Setup they make once the plan has resolved every "auto".

    shape = RunShape.of(cfg, placement, layout=None, compiled=False, pin_memory=True)
    engine = shape.engine_plan(spec, tier, boundaries, tiles, share)   # engine/plan.py
    setup = shape.setup(engine, micro_batch_size, grad_accum)          # planning/setup.py

planning/plan.py resolves the "auto" settings against the estimate of these plans. Invariant:
the GPU update share runs in one process only (a count given under ranks is refused here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatrain.config import TrainConfig
from megatrain.distributed import Placement
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.gpu_share import share_size, staging_sets
from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.plan import EnginePlan, TierSplit, tier_size
from megatrain.engine.tiling import TilePolicy, tileable, untiled_layers
from megatrain.layouts import LAYOUTS
from megatrain.planning.ranks import ONE_PROCESS, Ranks
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
    gpu_update_sets: int | str = "auto"  # the share's staging sets (choices.py), or "auto"

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
            gpu_update_sets=cfg.optimizer.gpu_update_sets,
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
        sets: int = 1,
    ) -> EnginePlan:
        """The engine's plan with `tier` blocks, `boundaries`, `tiles` (a count for "auto") and
        `share` blocks updated on the GPU through `sets` staging sets (1 where the share holds
        fewer than two blocks)."""
        policy, n = self.tile_policy(spec, tiles), spec.num_layers
        tier = min(tier, tier_size(n))
        return EnginePlan(
            num_slots=self.num_slots,
            clip_norm=self.clip_norm,
            loss_chunk_tokens=self.loss_chunk_tokens or default_chunk_tokens(spec.vocab_size),
            compile_layers=self.compiled,
            gpu_state_blocks=tier,
            boundaries=boundaries,
            tiles=policy,
            untiled=untiled_layers(spec.structure) if policy is not None else frozenset(),
            world_size=self.ranks.world,
            rank=self.rank,
            train_vision=self.vision.tower,
            train_projector=self.vision.projector,
            gpu_update_blocks=share,
            share_sets=staging_sets(sets, share_size(n, TierSplit.of(n, tier), share)),
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
