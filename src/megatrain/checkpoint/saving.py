"""Checkpoints that resume exactly: the single-process writer and the reader (one process).

Layout of one checkpoint, `<output_dir>/checkpoints/step-<N>/` (names: run_files.py):
    blocks/<block>.safetensors   master, exp_avg, exp_avg_sq of one store block, as stored: the
                                 master fp32 or bf16 (store/master.py), the states fp32, bf16,
                                 or int8 / int4 codes plus exp_avg_scale and exp_avg_sq_scale
                                 (store/states.py) (metadata: the block's optimizer step,
                                 parameter names, state_dtype and master_dtype)
                                 (a block held on the GPU, optimizer-state tier, is saved
                                 from the device into the same files)
    trainer_state.json           step, run id, data loader position, RNG states (the recipe's)
    config.yaml                  the resolved run config (and a recipe's own files, e.g. GRPO's
                                 KL reference)

Size: `part_bytes(store)` is the bytes of the tensors this process writes, each at its own
dtype; planning/disk.py's `checkpoint_bytes` predicts the same number from the parameter
counts before the model is loaded (tests/checkpoint/test_checkpointer.py holds them equal).

Sharded runs (several ranks, store/shard.py): each rank writes its part of every block as
`blocks/<block>.rank<r>-of-<W>.safetensors` into the same temporary directory
(checkpoint/shards.py); after every rank's files are fsynced (a barrier), rank 0 writes
trainer_state.json (with the world size) and renames the directory into place: that rename is
the one commit, so a checkpoint counts only once every rank's part is durable. A sharded
checkpoint loads into a store of the same world size, or whole (one process reading all parts
in rank order, the padding dropped: `megatrain export`).

Atomicity: a checkpoint is written into a hidden temporary directory next to its final place,
every file fsynced, then renamed into place in one `os.rename`, and the parent directory
fsynced. A crash mid-save leaves only the temporary directory, which is never taken for a
checkpoint and is removed by the next save; the previous checkpoint is never touched before the
new one is complete. Pruning to `keep_last` happens only after that rename.

Ownership: every checkpoint records the `run_id` of the run lineage that wrote it (a resumed run
inherits the id of the checkpoint it resumed from). Pruning considers only checkpoints of the
saving run's lineage, so a run never deletes a checkpoint it did not write; a same-step
checkpoint of another lineage is moved aside to `step-<N>.other-run-<id>`, never deleted.

Disk full: a save that hits ENOSPC removes its temporary folder and raises `DiskFullError`
(megatrain.planning.disk), one paragraph with the folder and the numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.checkpoint.files import (
    block_file,
    block_files,
    check_block,
    free_name,
    fsync,
    fsync_dir,
    write_json,
)
from megatrain.disk_space import disk_full_error, is_disk_full
from megatrain.files import honour_umask
from megatrain.run_files import BLOCKS_DIR, CHECKPOINTS_DIR, TRAINER_STATE_FILE, step_dir
from megatrain.store.host import HostStore

_STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT_VERSION = 1


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    store: HostStore,
    trainer_state: dict[str, Any],
    *,
    keep_last: int,
    run_id: str,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` of run lineage `run_id` atomically; returns its directory.
    `write_extra(folder)` adds the caller's files before the commit."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    final = root / step_dir(step)
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    try:
        (tmp / BLOCKS_DIR).mkdir(parents=True)
        write_blocks(tmp, store)
        write_state(tmp, step, {**trainer_state, "run_id": run_id}, write_extra)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(root, f"checkpoint step {step}", part_bytes(store)) from e
        raise
    commit(root, tmp, final, step, keep_last=keep_last, run_id=run_id)
    return final


def part_bytes(store: HostStore) -> int:
    """Bytes of the tensors this process writes into a checkpoint (its part of every block when
    sharded): the master and every AdamW state tensor at its own dtype; no file headers."""
    return sum(
        t.numel() * t.element_size()
        for b in store.blocks
        for t in (b.master, *b.state_tensors().values())
    )


def commit(root: Path, tmp: Path, final: Path, step: int, *, keep_last: int, run_id: str) -> None:
    """Move a complete temporary checkpoint into place (the commit), then prune."""
    if final.exists() and checkpoint_run_id(final) != run_id:
        os.rename(final, free_name(root / f"{final.name}.other-run-{checkpoint_run_id(final)}"))
    if final.exists():  # re-saving a step of this lineage (after a resume): swap, drop the old
        old = root / f".step-{step:08d}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    _prune(root, keep_last, run_id)


def write_blocks(tmp: Path, store: HostStore) -> None:
    """Write (this rank's part of) every block into `tmp`/blocks, each file fsynced."""
    for block in store.blocks:
        path = tmp / BLOCKS_DIR / block_file(block)
        save_file(
            {  # .cpu(): a GPU-tier block is saved from the device into the same files
                "master": block.master.cpu(),
                **{name: t.cpu() for name, t in block.state_tensors().items()},
            },
            str(path),
            metadata={
                "step": str(block.step),
                "names": json.dumps([[e.full_name, list(e.shape)] for e in block.entries]),
                "state_dtype": block.state_dtype,
                "master_dtype": block.master_dtype,
            },
        )
        honour_umask(path)  # save_file writes 0600
        fsync(path)
    fsync_dir(tmp / BLOCKS_DIR)


def write_state(
    tmp: Path,
    step: int,
    trainer_state: dict[str, Any],
    write_extra: Callable[[Path], None] | None,
) -> None:
    state = {"format_version": FORMAT_VERSION, "step": step, **trainer_state}
    write_json(tmp / TRAINER_STATE_FILE, state)
    if write_extra is not None:
        write_extra(tmp)
    fsync_dir(tmp)


def checkpoint_run_id(path: str | Path) -> str | None:
    """The run lineage that wrote a checkpoint; None for one without (written before run ids)."""
    try:
        state = json.loads((Path(path) / TRAINER_STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    run_id = state.get("run_id")
    return run_id if isinstance(run_id, str) else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / TRAINER_STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resume_path(resume_from: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint `checkpoint.resume_from` names: None (no resume), "auto" (the latest in
    output_dir; None with a message when there is none) or a path."""
    if resume_from is None:
        return None
    if resume_from != "auto":
        return Path(resume_from)
    path = latest_checkpoint(output_dir)
    if path is None:
        print(f"resume: no checkpoint under {output_dir}/checkpoints, starting fresh", flush=True)
    return path


def load_checkpoint(path: str | Path, store: HostStore) -> dict[str, Any]:
    """Fill `store` (master, AdamW states, step counters) from a checkpoint; returns its state."""
    path = Path(path)
    state_file = path / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint (no trainer_state.json); give a "
            "step-N directory under <output_dir>/checkpoints, or 'auto'"
        )
    for block in store.blocks:
        targets = {"master": block.master, **block.state_tensors()}
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in targets}
        for file in block_files(path, block):
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata()
                check_block(path, block, meta)
                for key, found in parts.items():
                    found.append(f.get_tensor(key))
                block.step = int(meta["step"])
        for key, dst in targets.items():
            # a whole block from a sharded checkpoint's parts: concatenated, padding dropped
            # (int8 / int4 shards are whole quantization blocks: their codes, scales concatenate)
            dst.copy_(torch.cat(parts[key])[: dst.numel()])
        block.refresh_shadow()
    state: dict[str, Any] = json.loads(state_file.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {state.get('format_version')}, this "
            f"MegaTrain reads format {FORMAT_VERSION}"
        )
    return state


def _prune(root: Path, keep_last: int, run_id: str) -> None:
    """Delete all but the newest `keep_last` checkpoints of lineage `run_id`; no other ones."""
    ours = [p for p in list_checkpoints(root.parent) if checkpoint_run_id(p) == run_id]
    for path in ours[:-keep_last]:
        shutil.rmtree(path)


def remove_stale_temporaries(root: Path) -> None:
    for path in root.iterdir():
        if path.name.startswith(".step-") and (".tmp-" in path.name or ".old-" in path.name):
            shutil.rmtree(path, ignore_errors=True)
