"""Checkpoints that resume exactly, and export to Hugging Face format.

Layout of one checkpoint, `<output_dir>/checkpoints/step-<N>/`:
    blocks/<block>.safetensors   fp32 master, exp_avg, exp_avg_sq of one store block
                                 (metadata: the block's optimizer step and parameter names);
                                 the same for a block held on the GPU (optimizer-state tier)
    trainer_state.json           step, data loader position, RNG states, metrics
    config.yaml                  the resolved run config

Atomicity: a checkpoint is written into a hidden temporary directory next to its final place,
every file fsynced, then renamed into place in one `os.rename`, and the parent directory
fsynced. A crash mid-save leaves only the temporary directory, which is never taken for a
checkpoint and is removed by the next save; the previous checkpoint is never touched before the
new one is complete. Pruning to `keep_last` happens only after that rename.
"""

from __future__ import annotations

import base64
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

from megatrain.store.host import HostStore

_STEP_DIR = re.compile(r"^step-(\d+)$")
FORMAT_VERSION = 1


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    store: HostStore,
    trainer_state: dict[str, Any],
    *,
    keep_last: int,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` atomically; returns its directory."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp-{os.getpid()}"
    (tmp / "blocks").mkdir(parents=True)
    for block in store.blocks:
        path = tmp / "blocks" / f"{block.name}.safetensors"
        save_file(
            {  # .cpu(): a GPU-tier block is saved from the device into the same files
                "master": block.master.cpu(),
                "exp_avg": block.exp_avg.cpu(),
                "exp_avg_sq": block.exp_avg_sq.cpu(),
            },
            str(path),
            metadata={
                "step": str(block.step),
                "names": json.dumps([[e.full_name, list(e.shape)] for e in block.entries]),
            },
        )
        _fsync(path)
    state = {"format_version": FORMAT_VERSION, "step": step, **trainer_state}
    _write_json(tmp / "trainer_state.json", state)
    if write_extra is not None:
        write_extra(tmp)
    _fsync_dir(tmp / "blocks")
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old one
        old = root / f".step-{step:08d}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


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
        file = path / "blocks" / f"{block.name}.safetensors"
        if not file.is_file():
            raise FileNotFoundError(
                f"checkpoint {path} has no {file.name}: it was written for a different model"
            )
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata()
            expected = [[e.full_name, list(e.shape)] for e in block.entries]
            if json.loads(meta["names"]) != expected:
                raise ValueError(
                    f"checkpoint {path}: block {block.name} holds different "
                    "parameters than this model; resume with the model it was "
                    "trained with"
                )
            for key, dst in (
                ("master", block.master),
                ("exp_avg", block.exp_avg),
                ("exp_avg_sq", block.exp_avg_sq),
            ):
                dst.copy_(f.get_tensor(key))
            block.step = int(meta["step"])
        block.refresh_shadow()
    state: dict[str, Any] = json.loads(state_file.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {state.get('format_version')}, this "
            f"MegaTrain reads format {FORMAT_VERSION}"
        )
    return state


def export_hf(
    store: HostStore, out_dir: str | Path, *, dtype: str = "bf16", tokenizer: Any | None = None
) -> Path:
    """Write a Hugging Face model folder (safetensors, config, tokenizer) atomically."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"checkpoint.export_dtype={dtype!r} must be 'bf16' or 'fp32'")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
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
    for file in tmp.iterdir():
        _fsync(file)
    _fsync_dir(tmp)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
    _fsync_dir(out.parent)
    return out


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


def _prune(root: Path, keep_last: int) -> None:
    for path in list_checkpoints(root.parent)[:-keep_last]:
        shutil.rmtree(path)


def _remove_stale_temporaries(root: Path) -> None:
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
