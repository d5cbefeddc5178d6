"""What one prediction is of: the engine's resolved plan and the step's batch.

`Setup` is the estimate's whole input besides the model and the hardware
(planning/estimate.py `estimate(spec, setup, hardware)`); the planner builds it from the run's
config (planning/run_shape.py `RunShape.setup`), tests and `megatrain estimate`'s what-if flags
build their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.engine.gpu_share import BlockFormats
from megatrain.engine.plan import EnginePlan
from megatrain.layouts import LAYOUTS
from megatrain.planning.ranks import ONE_PROCESS, Ranks
from megatrain.store.grads import gradient_hold


@dataclass(frozen=True)
class VisionLoad:
    """A vision-language run: whether its tower / projector train (model.freeze_vision /
    freeze_projector false), and the share of the step's tokens that are image tokens (each
    one a few patches through the tower: planning/timing.py)."""

    tower: bool = False
    projector: bool = False
    image_share: float = 0.0


NO_VISION = VisionLoad()


@dataclass(frozen=True)
class Setup:
    """One training setup to predict: the engine's plan and the step's batch."""

    engine: EnginePlan
    seq_len: int
    micro_batch_size: int
    grad_accum: int = 1
    layout: str = "padded"  # "padded" rows (masks), "packed" samples, "full" rows (no mask)
    state_dtype: str = "fp32"  # AdamW m and v on the host: choices.py STATE_DTYPES
    master_dtype: str = "fp32"  # master weights on the host: "fp32" or "bf16" (store/master.py)
    grad_dtype: str = "bf16"  # a bf16 master's held gradients (store/grads.py)
    pin_memory: bool = True
    data_bytes: int = 0  # the tokenized data in host memory
    ranks: Ranks = ONE_PROCESS  # several: per-rank batch and GPU, per-node host
    vision: VisionLoad = NO_VISION
    cuda: bool = True  # the GPU is a CUDA device (its allocator's slack counts: GPU estimate)

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        assert self.layout in LAYOUTS, self.layout

    def block_formats(self, bf16_compute: bool) -> BlockFormats:
        """How the store will keep its blocks (the GPU update share's device buffers)."""
        clipping = self.engine.clip_norm is not None
        hold = gradient_hold(
            self.master_dtype, self.grad_dtype, clipping=clipping, bf16_compute=bf16_compute
        )
        return BlockFormats(self.master_dtype, self.state_dtype, hold)

    @property
    def tokens_mb(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def tile_count(self) -> int:
        tiles = self.engine.tiles
        return 1 if tiles is None else tiles.count(self.seq_len)
