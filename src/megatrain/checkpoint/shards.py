"""Checkpoints of a sharded run: every rank writes its part, rank 0 commits once all are durable.

1. rank 0 clears stale temporaries and creates `.step-<N>.tmp-ranks/blocks` (then a barrier);
2. every rank writes its part of every block there, each file fsynced (checkpoint.write_blocks),
   and its own files of the recipe's (GRPO's part of the KL reference);
3. a barrier that also carries failures: if any rank failed (disk full, I/O error), its error
   is raised on that rank, the others stop quietly, and nothing is committed;
4. rank 0 writes trainer_state.json (with the world size) and config.yaml, renames the
   directory into place and prunes, exactly as a single-process save (checkpoint.commit).

Export (checkpoint/export.py `export_sharded`): the blocks are all-gathered and rank 0 writes
one ordinary Hugging Face folder.

The output folder must be one file system every rank sees (on several nodes, a shared one).
A crash before step 4 leaves only the temporary directory, removed by the next save.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatrain.checkpoint.saving import (
    checkpoints_dir,
    commit,
    part_bytes,
    remove_stale_temporaries,
    write_blocks,
    write_state,
)
from megatrain.disk_space import disk_full_error, is_disk_full
from megatrain.distributed import on_every_rank, on_rank0
from megatrain.run_files import BLOCKS_DIR, step_dir
from megatrain.store.host import HostStore


def save_sharded_checkpoint(
    output_dir: str | Path,
    step: int,
    store: HostStore,
    trainer_state: dict[str, Any],
    *,
    world_size: int,
    keep_last: int,
    run_id: str,
    write_extra: Callable[[Path], None] | None = None,
    write_part_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` of lineage `run_id` from every rank; returns its directory.
    `write_extra(folder)` runs on rank 0 (its files: the config...), `write_part_extra(folder)`
    on every rank (its own files beside its parts, step 2)."""
    root = checkpoints_dir(output_dir)
    final = root / step_dir(step)
    tmp = root / f".step-{step:08d}.tmp-ranks"

    def start() -> None:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)
        (tmp / BLOCKS_DIR).mkdir(parents=True)

    def write_part() -> None:
        try:
            write_blocks(tmp, store)
            if write_part_extra is not None:
                write_part_extra(tmp)
        except BaseException as e:
            if is_disk_full(e):
                needed = world_size * part_bytes(store)  # every rank's part is alike
                raise disk_full_error(root, f"checkpoint step {step}", needed) from e
            raise

    def finish() -> None:
        try:
            state = {**trainer_state, "run_id": run_id, "world_size": world_size}
            write_state(tmp, step, state, write_extra)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e):
                raise disk_full_error(root, f"checkpoint step {step}", 0) from e
            raise
        commit(root, tmp, final, step, keep_last=keep_last, run_id=run_id)

    on_rank0(start)
    on_every_rank(write_part)  # the barrier: every rank's part is durable, or none commits
    on_rank0(finish)
    return final
