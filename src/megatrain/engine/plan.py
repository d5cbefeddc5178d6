"""What the engine executes: one resolved plan, no "auto" left in it.

The planner (megatrain/planning/resolve.py) turns a run's config, the model and the hardware
into an `EnginePlan`; `StreamingEngine(structure, store, optimizer, plan, device=...)` runs it
and reads no other setting. The estimate predicts the same object (planning/estimate.py), so
what was checked is what runs.

The GPU tier's order rule lives here, once: `tier_order` (layers in forward order, then the
embedding, then the head; engine/tier.py says why). The engine applies it to the store's
blocks, the planner to the spec's block sizes.

Invariants: every field is a resolved value (a count, a policy or None with a stated meaning);
`gpu_state_blocks` is at most `len(tier_order(...))` of the model; `gpu_update_blocks` (the
GPU update share, engine/gpu_share.py) counts streamed blocks only (more: all), and is 0 under
ranks; `share_sets` is one of choices.py STAGING_SET_CHOICES, 1 where the share holds fewer
than two blocks; `untiled` names layers the MLP tiles skip (engine/tiling.py `untiled_layers`), and
`tiles` is None where no layer may be tiled at all (layers that draw random numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from megatrain.choices import STAGING_SET_CHOICES
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.tiling import TilePolicy

T = TypeVar("T")


def tier_order(layers: Sequence[T], embed: T, head: T) -> list[T]:
    """The order blocks join the GPU tier: decoder layers, then the embedding, then the head
    (engine/tier.py says why); a tier of k blocks is the first k. `T` is a block, or what the
    planner knows of one (its size)."""
    return [*layers, embed, head]


def tier_names(num_layers: int, count: int) -> list[str]:
    """The store's names (store/host.py) of the first `count` blocks of `tier_order`."""
    return tier_order([f"layer.{i}" for i in range(num_layers)], "embed", "head")[: max(count, 0)]


def tier_size(num_layers: int) -> int:
    """Blocks a GPU tier can hold: every block of `tier_order`."""
    return len(tier_order(range(num_layers), -1, -1))


@dataclass(frozen=True)
class TierSplit:
    """Which blocks the first `count` of `tier_order` are."""

    layers: int  # the first layers, in forward order
    embed: bool
    head: bool

    @classmethod
    def of(cls, num_layers: int, count: int) -> TierSplit:
        tier = tier_order(list(range(num_layers)), "embed", "head")[: max(count, 0)]
        return cls(sum(isinstance(b, int) for b in tier), "embed" in tier, "head" in tier)


@dataclass(frozen=True)
class EnginePlan:
    """Every setting the engine's memory and schedule depend on, resolved."""

    num_slots: int  # device slots of the streamed layers (more than streamed layers: unused)
    clip_norm: float | None  # global gradient-norm clipping; None: off
    loss_chunk_tokens: int  # tokens per fused loss chunk (engine/head.py)
    compile_layers: bool = False  # decoder layers torch.compile'd
    gpu_state_blocks: int = 0  # first blocks of `tier_order` whose states live on the device
    boundaries: BoundaryPlan | None = None  # where layer inputs wait; None: on the device
    tiles: TilePolicy | None = None  # MLP sequence tiles (engine/tiling.py); None: not tiled
    untiled: frozenset[int] = frozenset()  # layers the tiles skip (router logits recorded)
    world_size: int = 1  # ranks of the job; >1: the store holds this rank's shards
    rank: int = 0
    train_vision: bool = False  # a vision-language model's vision tower trains (store.vision)
    train_projector: bool = False  # ... its projector trains
    gpu_update_blocks: int = 0  # streamed blocks (head, then last layers) updated on the GPU
    share_sets: int = 1  # the share's device staging sets, taken in turn (engine/gpu_share.py)

    def __post_init__(self) -> None:
        assert self.num_slots >= 1, self.num_slots
        assert self.clip_norm is None or self.clip_norm > 0, "clipping off is None, not 0"
        assert self.loss_chunk_tokens >= 1, self.loss_chunk_tokens
        assert self.gpu_state_blocks >= 0, self.gpu_state_blocks
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)
        assert self.gpu_update_blocks >= 0, self.gpu_update_blocks
        assert self.world_size == 1 or not self.gpu_update_blocks, "the planner refuses it"
        assert self.share_sets in STAGING_SET_CHOICES, self.share_sets
        assert self.share_sets == 1 or self.gpu_update_blocks > 1, "sets beyond the blocks"

    def boundary_plan(self, num_layers: int) -> BoundaryPlan:
        """Where each layer's input waits for the backward."""
        plan = self.boundaries or BoundaryPlan.on_device(num_layers)
        assert plan.num_layers == num_layers, (plan.num_layers, num_layers)
        return plan

    @property
    def tile_count(self) -> int | None:
        """The fixed tile count; None: by row length (TilePolicy), 0: not tiled."""
        return 0 if self.tiles is None else self.tiles.tiles

    def describe(self) -> str:
        """The settings a step-down changes, in words (recipes/oom.py)."""
        tiles = "not tiled" if self.tiles is None else f"MLP tiles {self.tiles.tiles or 'auto'}"
        layers = self.boundaries.describe() if self.boundaries else "layer inputs on the GPU"
        return f"GPU tier {self.gpu_state_blocks} blocks, {layers}, {tiles}"
