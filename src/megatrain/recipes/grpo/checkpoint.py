"""What a GRPO checkpoint holds beyond the base recipe's: the KL reference (grpo.beta > 0).

A mixin of GRPOTrainer (recipes/grpo/recipe.py), which owns every attribute declared below; it
is split out only to keep each file readable. The reference is the run's initial weights
(store/reference.py `ReferenceWeights`): every checkpoint writes it (under several ranks, each
rank its own part), a resume loads it back instead of taking the resumed weights, and the disk
check counts its bytes. The hooks are the base's (recipes/base.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatrain.config import TrainConfig
from megatrain.recipes.builder import RunBuilder
from megatrain.store.reference import ReferenceWeights, copy_bytes


class ReferenceCheckpoint:
    # Owned and set up by GRPOTrainer (recipes/grpo/recipe.py) and its base Recipe.
    cfg: TrainConfig
    builder: RunBuilder
    reference: ReferenceWeights | None

    def load_state(self, state: dict[str, Any], path: Path) -> None:
        if self.reference is not None:  # the reference is the run's initial weights
            self.reference.load(path)

    def write_rank_files(self, folder: Path) -> None:
        if self.reference is not None:  # under several ranks, each rank's part
            self.reference.save(folder)

    def extra_checkpoint_bytes(self) -> int:
        """The KL reference: a copy of what the engine streams, in the compute dtype (under
        several ranks, every rank's shards, padded as store/shard.py pads them)."""
        if self.cfg.grpo.beta <= 0:
            return 0
        spec = self.builder.spec
        return copy_bytes(
            spec.block_params, spec.compute_dtype.itemsize, self.builder.placement.world_size
        )
