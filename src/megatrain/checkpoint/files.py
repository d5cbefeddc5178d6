"""Which files of a checkpoint hold a store block, and the checks made as one is read.

A block is one file, `blocks/<block>.safetensors`, or in a checkpoint of W ranks (store/shard.py)
W files `blocks/<block>.rank<r>-of-<W>.safetensors`, one per rank's part. A store of the same
world size reads its own part; a whole (one-process) store reads every part in rank order (what
`megatrain export` does); any other mix is refused with the fix.

Durable writes: `write_json`, `fsync` and `fsync_dir` are how every checkpoint and export file
reaches the disk before the rename that commits it; `free_name` picks a name that moves a
folder aside without replacing anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatrain.run_files import BLOCKS_DIR
from megatrain.store.blocks import ParamBlock
from megatrain.store.shard import ShardedBlock


def block_file(block: ParamBlock) -> str:
    """A block's file name in a checkpoint: the whole block, or this rank's part of it."""
    if isinstance(block, ShardedBlock):
        return f"{block.name}.rank{block.rank:03d}-of-{block.world_size:03d}.safetensors"
    return f"{block.name}.safetensors"


def check_block(path: Path, block: ParamBlock, meta: dict[str, str]) -> None:
    expected = [[e.full_name, list(e.shape)] for e in block.entries]
    if json.loads(meta["names"]) != expected:
        raise ValueError(
            f"checkpoint {path}: block {block.name} holds different parameters than this "
            "model; resume with the model it was trained with"
        )
    saved_dtype = meta.get("state_dtype", "fp32")  # checkpoints before state_dtype
    if saved_dtype != block.state_dtype:
        raise ValueError(
            f"checkpoint {path} holds optimizer states in {saved_dtype} but this run "
            f"has optimizer.state_dtype: {block.state_dtype}; resume with "
            f"optimizer.state_dtype: {saved_dtype} (states are not converted)"
        )
    saved_master = meta.get("master_dtype", "fp32")  # checkpoints before master_dtype
    if saved_master != block.master_dtype:
        raise ValueError(
            f"checkpoint {path} holds {saved_master} master weights but this run has "
            f"optimizer.master_dtype: {block.master_dtype}; resume with "
            f"optimizer.master_dtype: {saved_master} (masters are not converted)"
        )


def block_files(path: Path, block: ParamBlock) -> list[Path]:
    """The files holding `block`: its own, or (a whole block from a sharded checkpoint) every
    rank's part in rank order."""
    file = path / BLOCKS_DIR / block_file(block)
    if file.is_file():
        return [file]
    parts = sorted((path / BLOCKS_DIR).glob(f"{block.name}.rank*-of-*.safetensors"))
    if parts and not isinstance(block, ShardedBlock):
        return parts
    if parts or isinstance(block, ShardedBlock):
        raise ValueError(
            f"checkpoint {path} was written by a different number of ranks than this run "
            f"has (no {file.name}); resume with the same torchrun --nproc-per-node x --nnodes, "
            "or export it with megatrain export (one process reads every rank's part)"
        )
    raise FileNotFoundError(
        f"checkpoint {path} has no {file.name}: it was written for a different model"
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... whichever does not exist yet."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate
