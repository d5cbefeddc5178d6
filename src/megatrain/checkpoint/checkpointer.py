"""One run's checkpoints behind one interface, whether one process or several ranks write them.

    ckpt = Checkpointer(output_dir, world_size=W, keep_last=K)
    ckpt.bytes_needed(store)           # one checkpoint's tensor bytes, every rank's part
    ckpt.save(step, store, state, run_id=..., write_extra=...)   # atomic; prunes the lineage
    path = ckpt.resume_path("auto")    # the latest complete checkpoint, or a given one
    state = ckpt.load(path, store)     # refused unless written by W ranks

`save` writes through checkpoint/saving.py (one process) or checkpoint/shards.py (every rank
its part, rank 0 commits): the same folder layout, the same atomic commit, the same pruning to
`keep_last` within the run lineage `run_id` (a run never deletes a checkpoint it did not write).

Invariants:
- `bytes_needed(store)` is the bytes of tensors a save writes (headers and the small files
  aside), each state at its own dtype (fp32, bf16, int8 / int4 with scales); it equals
  planning/disk.py `checkpoint_nbytes` of the run's parameter counts, which the disk check
  uses before the model is loaded. tests/checkpoint/test_checkpointer.py holds the three equal.
- `load` restores the store exactly as saved (master, states, per-block step) and returns the
  trainer state the recipe saved; it refuses a checkpoint of another world size with the fix,
  before reading any block. A whole-model read of a sharded checkpoint (`megatrain export`) uses
  saving.load_checkpoint directly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatrain.checkpoint.saving import (
    list_checkpoints,
    load_checkpoint,
    part_bytes,
    resume_path,
    save_checkpoint,
)
from megatrain.checkpoint.shards import save_sharded_checkpoint
from megatrain.run_files import TRAINER_STATE_FILE
from megatrain.store.host import HostStore


class Checkpointer:
    """The checkpoints under `output_dir`/checkpoints of a run of `world_size` ranks."""

    def __init__(self, output_dir: str | Path, *, world_size: int = 1, keep_last: int) -> None:
        self.output_dir = Path(output_dir)
        self.world_size = world_size
        self.keep_last = keep_last

    def bytes_needed(self, store: HostStore) -> int:
        """Tensor bytes of one checkpoint of `store` (every rank's part: the parts are alike)."""
        return self.world_size * part_bytes(store)

    def save(
        self,
        step: int,
        store: HostStore,
        trainer_state: dict[str, Any],
        *,
        run_id: str,
        write_extra: Callable[[Path], None] | None = None,
        write_part_extra: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint `step` of lineage `run_id` atomically (with several ranks, every
        rank calls it) and prune the lineage to `keep_last`; returns its folder. Into the
        folder before the commit: `write_extra(folder)` writes rank 0's files (the run's own:
        its config...), `write_part_extra(folder)` every rank's (its part of a recipe's state,
        named by rank; in one process, that process's)."""
        if self.world_size > 1:
            return save_sharded_checkpoint(
                self.output_dir,
                step,
                store,
                trainer_state,
                world_size=self.world_size,
                keep_last=self.keep_last,
                run_id=run_id,
                write_extra=write_extra,
                write_part_extra=write_part_extra,
            )

        def write_both(folder: Path) -> None:
            for write in (write_part_extra, write_extra):
                if write is not None:
                    write(folder)

        return save_checkpoint(
            self.output_dir,
            step,
            store,
            trainer_state,
            keep_last=self.keep_last,
            run_id=run_id,
            write_extra=write_both,
        )

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return list_checkpoints(self.output_dir)

    def resume_path(self, resume_from: str | None) -> Path | None:
        """What checkpoint.resume_from names: None, "auto" (the latest, or None) or a path."""
        return resume_path(resume_from, self.output_dir)

    def load(self, path: Path, store: HostStore) -> dict[str, Any]:
        """Fill `store` from checkpoint `path`, written by as many ranks as this run has."""
        saved = saved_world_size(path)
        if saved != self.world_size:
            raise ValueError(
                f"checkpoint {path} was written by {saved} rank(s) and this run has "
                f"{self.world_size}: resume with the same number of processes (torchrun "
                f"--nproc-per-node x --nnodes = {saved}), or export it (megatrain export) and "
                "start a new run from the exported model"
            )
        return load_checkpoint(path, store)


def saved_world_size(path: Path) -> int:
    """The ranks that wrote checkpoint `path` (1 for one written before sharding)."""
    return int(_trainer_state(path).get("world_size", 1))


def saved_threads(path: Path) -> int | None:
    """The CPU threads checkpoint `path` was computed with (recipes/base.py saves them; None
    for a checkpoint written before they were saved)."""
    threads = _trainer_state(path).get("threads")
    return int(threads) if threads is not None else None


def _trainer_state(path: Path) -> dict[str, Any]:
    """Checkpoint `path`'s trainer_state.json; {} when it has none (not a checkpoint: `load`
    says so)."""
    try:
        state = json.loads((path / TRAINER_STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}
