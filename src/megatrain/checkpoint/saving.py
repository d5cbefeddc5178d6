"""Checkpoints that resume exactly, and export to Hugging Face format.

Layout of one checkpoint, `<output_dir>/checkpoints/step-<N>/`:
    blocks/<block>.safetensors   fp32 master, exp_avg, exp_avg_sq of one store block, the states
                                 as stored (fp32, bf16, or int8 codes plus exp_avg_scale and
                                 exp_avg_sq_scale; store/states.py) (metadata: the block's
                                 optimizer step, parameter names and state_dtype)
                                 (a block held on the GPU, optimizer-state tier, is saved
                                 from the device into the same files)
    trainer_state.json           step, data loader position, RNG states, metrics
    config.yaml                  the resolved run config

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

Disk full: a save or export that hits ENOSPC removes its temporary folder and raises
`DiskFullError` (megatrain.planning.disk), one paragraph with the folder and the numbers.

Exports carry a marker, `megatrain_export.json`, listing their files. `export_hf` replaces a
folder only when it is empty or a previous export (or `overwrite=True` is given); the new export
is written next to it and swapped in by rename, and only the files the previous export listed
are removed. Anything else found in the folder is moved into the new export, or, on a name
clash, kept in `<out>.kept-<time>` beside it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.checkpoint.files import block_file, block_files, check_block
from megatrain.files import honour_umask
from megatrain.planning.disk import AFTER_EXPORT, disk_full_error, is_disk_full
from megatrain.store.host import HostStore

_STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT_VERSION = 1
EXPORT_MARKER = "megatrain_export.json"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


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
    """Write checkpoint `step` of run lineage `run_id` atomically; returns its directory."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    try:
        (tmp / "blocks").mkdir(parents=True)
        write_blocks(tmp, store)
        write_state(tmp, step, {**trainer_state, "run_id": run_id}, write_extra)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(root, f"checkpoint step {step}", checkpoint_bytes(store)) from e
        raise
    commit(root, tmp, final, step, keep_last=keep_last, run_id=run_id)
    return final


def checkpoint_bytes(store: HostStore) -> int:
    return sum(3 * b.master.numel() * b.master.element_size() for b in store.blocks)


def commit(root: Path, tmp: Path, final: Path, step: int, *, keep_last: int, run_id: str) -> None:
    """Move a complete temporary checkpoint into place (the commit), then prune."""
    if final.exists() and checkpoint_run_id(final) != run_id:
        os.rename(final, _free_name(root / f"{final.name}.other-run-{checkpoint_run_id(final)}"))
    if final.exists():  # re-saving a step of this lineage (after a resume): swap, drop the old
        old = root / f".step-{step:08d}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep_last, run_id)


def write_blocks(tmp: Path, store: HostStore) -> None:
    """Write (this rank's part of) every block into `tmp`/blocks, each file fsynced."""
    for block in store.blocks:
        path = tmp / "blocks" / block_file(block)
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
            },
        )
        honour_umask(path)  # save_file writes 0600
        _fsync(path)
    _fsync_dir(tmp / "blocks")


def write_state(
    tmp: Path,
    step: int,
    trainer_state: dict[str, Any],
    write_extra: Callable[[Path], None] | None,
) -> None:
    state = {"format_version": FORMAT_VERSION, "step": step, **trainer_state}
    _write_json(tmp / "trainer_state.json", state)
    if write_extra is not None:
        write_extra(tmp)
    _fsync_dir(tmp)


def checkpoint_run_id(path: str | Path) -> str | None:
    """The run lineage that wrote a checkpoint; None for one without (written before run ids)."""
    try:
        state = json.loads((Path(path) / "trainer_state.json").read_text())
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
        if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.json").is_file()
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
    state_file = path / "trainer_state.json"
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
            # (int8 shards are whole quantization blocks, so their scales concatenate too)
            dst.copy_(torch.cat(parts[key])[: dst.numel()])
        block.refresh_shadow()
    state: dict[str, Any] = json.loads(state_file.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {state.get('format_version')}, this "
            f"MegaTrain reads format {FORMAT_VERSION}"
        )
    return state


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
    if dtype not in ("bf16", "fp32"):
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
            needed = sum(b.master.numel() for b in store.blocks) * (2 if dtype == "bf16" else 4)
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
    _fsync_dir(out.parent)
    return out


def is_export(folder: str | Path) -> bool:
    return (Path(folder) / EXPORT_MARKER).is_file()


_EXPORT_FIX = (
    "Choose an empty or new folder, or pass --overwrite to write the export into it (files of "
    "other names are kept, never deleted)"
)


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
        training_use_cache = model.config.use_cache
        model.config.use_cache = True  # the exported model is for generation
        try:
            model.save_pretrained(str(tmp), safe_serialization=True)
        finally:
            model.config.use_cache = training_use_cache
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    files = sorted(p.name for p in tmp.iterdir())
    marker = {"format_version": FORMAT_VERSION, "dtype": dtype, "files": files}
    _write_json(tmp / EXPORT_MARKER, marker)
    honour_umask(*tmp.iterdir())  # save_pretrained writes model.safetensors 0600
    for file in tmp.iterdir():
        _fsync(file)
    _fsync_dir(tmp)


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
        kept = _free_name(out.parent / f"{out.name}.kept-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(old, kept)
        print(f"export: files of {out} that clash with the new export were kept in {kept}")
    else:
        old.rmdir()


def rng_state() -> dict[str, str]:
    state = {"cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, str]) -> None:
    torch.set_rng_state(_unb64(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _prune(root: Path, keep_last: int, run_id: str) -> None:
    """Delete all but the newest `keep_last` checkpoints of lineage `run_id`; no other ones."""
    ours = [p for p in list_checkpoints(root.parent) if checkpoint_run_id(p) == run_id]
    for path in ours[:-keep_last]:
        shutil.rmtree(path)


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ... whichever does not exist yet."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def remove_stale_temporaries(root: Path) -> None:
    for path in root.iterdir():
        if path.name.startswith(".step-") and (".tmp-" in path.name or ".old-" in path.name):
            shutil.rmtree(path, ignore_errors=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
