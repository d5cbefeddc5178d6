"""`ResourcePlan`: the batch a run uses, its estimate and the EnginePlan, what `resolve`
(planning/plan.py) returns."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.plan import EnginePlan
from megatrain.planning.estimate import Estimate
from megatrain.planning.setup import Setup


@dataclass(frozen=True)
class ResourcePlan:
    """The batch a run uses and what it is predicted to need; `problems` empty when it fits."""

    micro_batch_size: int
    grad_accum: int
    estimate: Estimate
    engine: EnginePlan  # what the engine runs (this rank's tier count: the builder agrees one)
    batch_reason: str | None  # why "auto" chose this micro-batch (None: it was given)
    problems: tuple[str, ...]
    setup: Setup  # what `estimate` predicted (engine, batch, store layout)
    tier_reason: str | None = None  # why "auto" chose the GPU tier (None: it was given)
    boundary_reason: str | None = None
    mlp_tiles: int = 1  # sequence tiles of the MLPs at seq_len (engine/tiling.py)
    tiles_reason: str | None = None  # why "auto" chose that many (None: set, or no choice)
    share_reason: str | None = None  # why "auto" chose the GPU update share (None: given)

    @property
    def gpu_state_blocks(self) -> int:
        """Blocks (layers, embedding, head) whose states live on the GPU: the engine's."""
        return self.engine.gpu_state_blocks

    @property
    def boundaries(self) -> BoundaryPlan | None:
        """Where layer inputs wait (None: all on the GPU): the engine's."""
        return self.engine.boundaries

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def tokens_per_step(self) -> int:
        return int(self.estimate.settings["tokens_per_step"])

    def require_fit(self) -> None:
        """Raise ValueError with the numbers and what to change when the run does not fit."""
        if self.problems:
            raise ValueError("this run does not fit: " + "; ".join(self.problems))
