"""The planning half of the one builder (megatrain/builder.py): config -> resource plan.

`PlanBuilder(cfg).plan()` reads the model's config alone and predicts the run (resources/plan.py);
the engine's "auto" settings (GPU tier, where layer inputs wait, MLP tiles) are read from that
plan here, so the run uses what the fit check saw. Under torchrun the placement is this rank's
and the GPU tier count is the least any rank planned (distributed.least_on_ranks).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatrain.config import TrainConfig
from megatrain.distributed import Placement, least_on_ranks, placement_here, rows_per_rank
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.tiling import TilePolicy
from megatrain.model.loading import load_config as load_hf_config
from megatrain.resources import Hardware, ModelSpec, detect, model_spec
from megatrain.resources.long_context import configured_boundaries
from megatrain.resources.plan import ResourcePlan, RunShape, plan_resources
from megatrain.resources.ranks import Ranks


class PlanBuilder:
    """A run's config -> its resource plan and the settings the plan resolves, before any
    weight exists (meta device). `RunBuilder` extends it with the parts that hold weights and
    data; `megatrain estimate` needs no more than this.

    Cached: `hf_config`, `spec`, `hardware` and the run's own `plan()` are built at most once,
    so the batch, GPU tier, layer-input plan and MLP tiles a run uses are those that were
    checked.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        hardware: Hardware | None = None,
        placement: Placement | None = None,
    ) -> None:
        """`placement` None: this process, alone, on `training.device` resolved here.
        `megatrain estimate` passes the placement it plans for (a GPU it may not have)."""
        self.cfg = cfg
        self.placement = placement or placement_here(cfg.training.device)
        self._hardware = hardware
        self._gpu_reserve_bytes = 0

    @property
    def device(self) -> torch.device:
        return self.placement.device

    # ---------------------------------------------------------------- plan (no weights)

    @functools.cached_property
    def hf_config(self) -> Any:
        m = self.cfg.model
        return load_hf_config(
            m.name_or_path,
            model_type=m.model_type,
            tiny=m.tiny,
            trust_remote_code=m.trust_remote_code,
            overrides=dict(m.config_overrides) or None,
        )

    @functools.cached_property
    def spec(self) -> ModelSpec:
        m = self.cfg.model
        return model_spec(self.hf_config, m.compute_dtype, m.attn_implementation)

    @functools.cached_property
    def hardware(self) -> Hardware:
        return self._hardware or detect()

    @property
    def pin_memory(self) -> bool:
        """Pinned host buffers: asked for, and useful (only CUDA copies from them)."""
        return self.cfg.memory.pin_memory and self.placement.is_cuda

    def shape(self, layout: str | None = None) -> RunShape:
        cfg, p = self.cfg, self.placement
        return RunShape(
            seq_len=cfg.seq_len,
            num_slots=cfg.memory.num_slots,
            layout=layout or cfg.layout,
            clipping=cfg.optimizer.clip_norm is not None,
            loss_chunk_tokens=cfg.memory.loss_chunk_tokens,
            pin_memory=self.pin_memory,
            check_gpu=p.is_cuda,
            state_dtype=cfg.optimizer.state_dtype,
            gpu_state_blocks=cfg.memory.gpu_state_blocks,
            compiled=cfg.training.compile_layers,
            ranks=Ranks(p.local_world_size, p.world_size // p.local_world_size),
            activation_offload=cfg.memory.activation_offload,
            checkpoint_every=cfg.memory.checkpoint_every,
            mlp_tiles=cfg.memory.mlp_tiles,
        )

    def plan(
        self, *, tokens_per_step: int | None = None, layout: str | None = None
    ) -> ResourcePlan:
        """The resource plan; the run's own (no arguments) is computed once and cached.

        `tokens_per_step` / `layout` ask what-if questions (megatrain estimate's flags).
        With `training.global_batch_size` and micro_batch_size "auto" the step's tokens are
        fixed at global_batch_size x seq_len.
        """
        if tokens_per_step is None and layout is None:
            return self._own_plan
        return self._plan(tokens_per_step, layout)

    def batch(self) -> tuple[int, int]:
        """(micro_batch_size, gradient accumulation) of the run: the config's, or the plan's
        when micro_batch_size is "auto" (the plan is then computed, else it is not needed)."""
        t = self.cfg.training
        if isinstance(t.micro_batch_size, int):
            return t.micro_batch_size, t.gradient_accumulation_steps
        plan = self.plan()
        return plan.micro_batch_size, plan.grad_accum

    @functools.cached_property
    def _own_plan(self) -> ResourcePlan:
        return self._plan(None, None)

    def _plan(self, tokens_per_step: int | None, layout: str | None) -> ResourcePlan:
        t, mem = self.cfg.training, self.cfg.memory
        if tokens_per_step is None and t.global_batch_size and t.micro_batch_size == "auto":
            rows = rows_per_rank(t.global_batch_size, self.placement.world_size)
            tokens_per_step = rows * self.cfg.seq_len
        return plan_resources(
            self.spec,
            self.shape(layout),
            hardware=self.hardware,
            micro_batch_size=t.micro_batch_size,
            grad_accum=t.gradient_accumulation_steps,
            tokens_per_step=tokens_per_step,
            gpu_margin_gib=mem.gpu_margin_gib,
            host_margin_gib=mem.host_margin_gib,
            gpu_reserve_bytes=self._gpu_reserve_bytes,
        )

    def reserve_gpu(self, nbytes: int) -> None:
        """Leave `nbytes` of GPU memory beside the engine's persistent buffers for another
        phase of the run (GRPO's rollout): the automatic GPU tier is chosen around it. Call
        before the engine is built (it takes the tier from the plan)."""
        if nbytes != self._gpu_reserve_bytes:
            self._gpu_reserve_bytes = nbytes
            self.__dict__.pop("_own_plan", None)  # planned again with the reservation

    def tile_policy(self) -> TilePolicy | None:
        """The MLPs' sequence tiles (engine/tiling.py): memory.mlp_tiles, or for "auto" on the
        GPU the plan's count (the fewest whose peak fits; the plan is then computed)."""
        mem, t = self.cfg.memory, self.cfg.training
        policy = TilePolicy.from_setting(mem.mlp_tiles, t.compile_layers)
        if policy is None or mem.mlp_tiles != "auto" or not self.placement.is_cuda:
            return policy
        return self.plan().tile_policy(self.cfg.seq_len)

    def boundary_plan(self, num_layers: int) -> BoundaryPlan:
        """Where the layers' saved inputs wait: without "auto" in memory.activation_offload
        and memory.checkpoint_every (or on the CPU), straight from them; else the plan's."""
        mem = self.cfg.memory
        plan = configured_boundaries(
            num_layers, mem.activation_offload, mem.checkpoint_every, self.placement.is_cuda
        )
        plan = plan or self.plan().boundaries
        assert plan is not None
        return plan

    def gpu_state_blocks(self, num_layers: int) -> int:
        """GPU-tier blocks (layers, then embedding, then head): the config's count (clamped to
        the model), or the plan's for "auto" (the plan is then computed, else not needed).
        Several ranks: the least count of any rank (each plans its own GPU; the collectives
        of a sharded tier need one count)."""
        blocks = self.cfg.memory.gpu_state_blocks
        count = min(blocks, num_layers + 2) if isinstance(blocks, int) else None
        return least_on_ranks(self.plan().gpu_state_blocks if count is None else count)
