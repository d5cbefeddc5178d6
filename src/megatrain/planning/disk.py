"""Disk a training run writes (byte arithmetic from the parameter counts); the free-space check.

What a run writes under `training.output_dir`:
    checkpoint    `checkpoint_nbytes`: per store block its master at the run's
                  optimizer.master_dtype (4 bytes per parameter fp32, 2 bf16; store/master.py)
                  and AdamW exp_avg, exp_avg_sq at the run's optimizer.state_dtype (8 fp32, 4
                  bf16, 2 + the int8 scales, 1 + the int4 scales; store/states.py), every
                  rank's padded part when sharded: 12, 8, ~6 or ~5 bytes per parameter with an
                  fp32 master (2 less with bf16). The checkpoint writer writes exactly these
                  bytes of tensors (checkpoint/saving.py `part_bytes`), plus small files
                  (trainer_state.json with the RNG states, config.yaml); `keep_last` of them
                  are kept, and while the next one is written (into a temporary folder, before
                  the oldest is pruned) keep_last + 1 exist at once
    HF export     2 (bf16) or 4 (fp32) bytes per parameter, plus config and tokenizer files;
                  written after the last checkpoint, while the kept checkpoints still exist
    metrics       one JSON line per optimizer step and evaluation (under 2 KiB each)

The check refuses a run whose peak exceeds the free space of output_dir's filesystem *before*
the model is loaded, so no training time is spent on a run that cannot save its result.
`DiskFullError` is what a save raises when the disk fills anyway (another writer, a wrong
estimate): one paragraph naming the folder, the bytes needed and free, and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from megatrain.disk_space import EXPORT_BYTES_PER_PARAM, GIB, free_bytes
from megatrain.store.master import master_bytes_per_param
from megatrain.store.shard import shard_range
from megatrain.store.states import state_bytes_per_param, state_nbytes

SMALL_FILES_BYTES = 64 * 2**20  # tokenizer, configs, trainer_state.json, safetensors headers
METRICS_BYTES_PER_STEP = 2048  # a train record (~1 KiB with the timeline) and an eval record


@dataclass(frozen=True)
class RunDisk:
    """Bytes a run writes at its peak, and the parts that make it up."""

    checkpoint_bytes: int  # one checkpoint
    checkpoints_at_peak: int  # complete + the one being written
    checkpoints_kept: int  # after the last prune, while the export is written
    export_bytes: int  # 0 without an export
    metrics_bytes: int
    peak_bytes: int
    state_dtype: str = "fp32"  # the AdamW states' dtype in the checkpoints
    master_dtype: str = "fp32"  # the master weights' dtype in the checkpoints

    def describe(self) -> str:
        parts = []
        if self.checkpoints_at_peak:
            parts.append(
                f"{self.checkpoints_at_peak} checkpoint(s) of {_gib(self.checkpoint_bytes)} GiB "
                f"({self.master_dtype} weights and AdamW m, v in {self.state_dtype})"
            )
        if self.export_bytes:
            kept = f" written while {self.checkpoints_kept} checkpoint(s) are kept"
            parts.append(
                f"the Hugging Face export of {_gib(self.export_bytes)} GiB"
                + (kept if self.checkpoints_kept else "")
            )
        parts.append(f"{_gib(self.metrics_bytes + SMALL_FILES_BYTES)} GiB of metrics and configs")
        return "; ".join(parts)


def run_disk_bytes(
    num_params: int,
    *,
    save_every: int,
    save_final: bool,
    keep_last: int,
    export_hf: bool,
    export_dtype: str,
    total_steps: int | None,
    checkpoint_bytes: int | None = None,
    state_dtype: str = "fp32",
    master_dtype: str = "fp32",
) -> RunDisk:
    """Peak bytes a run writes to output_dir. `total_steps` None: unknown, assume many saves.
    `checkpoint_bytes`: one checkpoint's (`checkpoint_nbytes` of the run's blocks); None: the
    `num_params` as one block with `state_dtype` states and a `master_dtype` master."""
    ckpt = checkpoint_bytes
    if ckpt is None:
        ckpt = checkpoint_nbytes([num_params], state_dtype, master_dtype=master_dtype)
    if total_steps is None:
        saves = keep_last + 1 if save_every else int(save_final)
    else:
        periodic = total_steps // save_every if save_every else 0
        final = save_final and (not save_every or total_steps % save_every != 0)
        saves = periodic + int(final)
    at_peak = min(saves, keep_last + 1)
    kept = min(saves, keep_last)
    export = num_params * EXPORT_BYTES_PER_PARAM[export_dtype] if export_hf else 0
    metrics = METRICS_BYTES_PER_STEP * (total_steps if total_steps is not None else 100_000)
    peak = max(at_peak * ckpt, kept * ckpt + export) + metrics + SMALL_FILES_BYTES
    return RunDisk(ckpt, at_peak, kept, export, metrics, peak, state_dtype, master_dtype)


def checkpoint_nbytes(
    block_numels: Iterable[int], state_dtype: str, *, world: int = 1, master_dtype: str = "fp32"
) -> int:
    """Bytes of the tensors of one checkpoint of store blocks of `block_numels` parameters:
    each block's master in `master_dtype` and AdamW states in `state_dtype`; with `world`
    ranks, every rank's part of the block, padded as store/shard.py pads it."""
    master = master_bytes_per_param(master_dtype)
    total = 0
    for numel in block_numels:
        part = numel if world == 1 else shard_range(numel, 0, world)[2]
        total += world * (master * part + state_nbytes(part, state_dtype))
    return total


def checkpoint_bytes_per_param(state_dtype: str, master_dtype: str = "fp32") -> float:
    """A checkpoint's bytes per parameter: 12 (fp32 states), 8 (bf16), ~6 (int8), ~5 (int4)
    with an fp32 master; 2 less with a bf16 one."""
    return master_bytes_per_param(master_dtype) + state_bytes_per_param(state_dtype)


def check_run_disk(output_dir: str | Path, disk: RunDisk, *, already_written: int = 0) -> None:
    """Refuse, with the numbers and what to change, a run the output_dir's disk cannot hold.

    `already_written`: bytes of this run's lineage already on disk that the run replaces (the
    kept checkpoints of a resumed run are pruned as new ones are written).
    """
    needed = max(0, disk.peak_bytes - already_written)
    free = free_bytes(output_dir)
    if needed <= free:
        return
    raise ValueError(
        f"not enough disk for this run: training.output_dir={str(output_dir)!r} is on a "
        f"filesystem with {_gib(free)} GiB free, and the run writes up to {_gib(needed)} GiB "
        f"({disk.describe()}). Free space there, choose an output_dir on a larger disk, or "
        "write less: lower checkpoint.keep_last, set checkpoint.save_final: false (no "
        "resumable checkpoint at the end, only the Hugging Face export), raise "
        "checkpoint.save_every or set checkpoint.export_dtype: bf16"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
