"""The trained weights as a Hugging Face model folder (safetensors, config, tokenizer).

Exports carry a marker, `megatrain_export.json` (names.EXPORT_MARKER), listing their files.
`export_hf` replaces a folder only when it is empty or a previous export (or `overwrite=True`
is given); the new export is written next to it and swapped in by rename, and only the files
the previous export listed are removed. Anything else found in the folder is moved into the new
export, or, on a name clash, kept in `<out>.kept-<time>` beside it. `check_export_target`
applies that rule up front (a run checks its hf_model/ before training, not after).

Sharded runs (`export_sharded`): every rank's part of each block is all-gathered and rank 0
writes one ordinary folder, exactly as a single-process export.

Disk full: an export that hits ENOSPC removes its temporary folder and raises `DiskFullError`
(megatrain.planning.disk); checkpoints are untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatrain.checkpoint.files import free_name, fsync, fsync_dir, write_json
from megatrain.checkpoint.saving import FORMAT_VERSION
from megatrain.disk_space import (
    AFTER_EXPORT,
    EXPORT_BYTES_PER_PARAM,
    disk_full_error,
    is_disk_full,
)
from megatrain.distributed import all_gather, on_rank0
from megatrain.files import honour_umask
from megatrain.model.loading import no_progress_bars
from megatrain.run_files import EXPORT_MARKER
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.shard import ShardedBlock

_EXPORT_FIX = (
    "Choose an empty or new folder, or pass --overwrite to write the export into it (files of "
    "other names are kept, never deleted)"
)


def export_hf(
    store: HostStore,
    out_dir: str | Path,
    *,
    dtype: str = "bf16",
    tokenizer: Any | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model folder (safetensors, config, tokenizer) atomically.

    Refuses a non-empty `out_dir` that is not a previous export unless `overwrite`; never
    removes a file the previous export did not list (see the module docstring).
    """
    if dtype not in EXPORT_BYTES_PER_PARAM:
        raise ValueError(f"checkpoint.export_dtype={dtype!r} must be 'bf16' or 'fp32'")
    out = Path(out_dir)
    check_export_target(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write_export(store, tmp, dtype, tokenizer)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            needed = sum(b.master.numel() for b in store.blocks) * EXPORT_BYTES_PER_PARAM[dtype]
            what = f"the Hugging Face export {out.name}"
            raise disk_full_error(out.parent, what, needed, fix=AFTER_EXPORT) from e
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        _retire_previous_export(old, out)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)
    return out


def export_sharded(
    store: HostStore,
    out_dir: str | Path,
    *,
    device: torch.device,
    dtype: str,
    tokenizer: Any | None,
) -> Path:
    """Write one ordinary Hugging Face folder from a sharded store: every rank's part of each
    block is all-gathered (through `device`: NCCL reduces device tensors), rank 0 writes."""
    main = dist.get_rank() == 0
    whole: list[ParamBlock] = []
    for block in store.blocks:
        assert isinstance(block, ShardedBlock)
        full = torch.empty(block.padded_numel, dtype=block.master.dtype, device=device)
        all_gather(full, block.master.to(device))
        if main:
            master = full[: block.full_numel].cpu()
            empty = torch.empty(0)
            whole.append(
                ParamBlock(block.name, block.entries, block.full_numel, 0, master, empty, empty)
            )
    out = Path(out_dir)

    def write() -> None:
        sharded = (store.embed, store.layers, store.head)
        store.embed, store.layers, store.head = whole[0], whole[1:-1], whole[-1]
        try:
            export_hf(store, out, dtype=dtype, tokenizer=tokenizer)
        finally:
            store.embed, store.layers, store.head = sharded

    on_rank0(write)
    return out


def is_export(folder: str | Path) -> bool:
    return (Path(folder) / EXPORT_MARKER).is_file()


def check_export_target(
    out: str | Path, *, overwrite: bool = False, key: str = "--out", fix: str = _EXPORT_FIX
) -> None:
    """Refuse a non-empty folder that is not a previous MegaTrain export, unless `overwrite`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{key} {out} is a file, not a folder; give a folder for the export")
    if overwrite or not out.is_dir() or is_export(out) or not any(out.iterdir()):
        return
    raise ValueError(
        f"{key} {out} is not empty and is not a previous MegaTrain export (it has no "
        f"{EXPORT_MARKER}); exporting there would mix the model with files it did not write. " + fix
    )


def _write_export(store: HostStore, tmp: Path, dtype: str, tokenizer: Any | None) -> None:
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    with store.bound(torch_dtype) as model:
        text = model.config.get_text_config()  # a vision-language model's: its language part
        training_use_cache = getattr(text, "use_cache", False)
        text.use_cache = True  # the exported model is for generation
        try:
            with no_progress_bars():  # "Writing model shards": the run prints its own line
                model.save_pretrained(str(tmp), safe_serialization=True)
        finally:
            text.use_cache = training_use_cache
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    files = sorted(p.name for p in tmp.iterdir())
    marker = {"format_version": FORMAT_VERSION, "dtype": dtype, "files": files}
    write_json(tmp / EXPORT_MARKER, marker)
    honour_umask(*tmp.iterdir())  # save_pretrained writes model.safetensors 0600
    for file in tmp.iterdir():
        fsync(file)
    fsync_dir(tmp)


def _retire_previous_export(old: Path, out: Path) -> None:
    """Remove what the previous export listed; move anything else into the new export."""
    listed: set[str] = set()
    if is_export(old):
        listed = set(json.loads((old / EXPORT_MARKER).read_text()).get("files", []))
        listed.add(EXPORT_MARKER)
    for path in list(old.iterdir()):
        if path.name in listed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        elif not (out / path.name).exists():
            os.rename(path, out / path.name)
    if any(old.iterdir()):
        kept = free_name(out.parent / f"{out.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(old, kept)
        print(f"export: files of {out} that clash with the new export were kept in {kept}")
    else:
        old.rmdir()
