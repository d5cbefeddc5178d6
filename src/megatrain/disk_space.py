"""Disk space: how much is free, and the error of a save that fills the disk.

Base module (no torch): the planner's disk check (planning/disk.py), the checkpoint writers
(checkpoint/) and the CLI, which prints `DiskFullError` as one paragraph, all use it.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

GIB = 2**30
EXPORT_BYTES_PER_PARAM = {"bf16": 2, "fp32": 4}
"""A Hugging Face export's bytes per parameter, by checkpoint.export_dtype."""


class DiskFullError(OSError):
    """A save ran out of disk space; str() is the user-facing paragraph."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def free_bytes(folder: str | Path) -> int:
    """Free bytes of the filesystem that holds `folder` (or its nearest existing parent)."""
    path = Path(folder).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC as an OSError, or as the safetensors writer's error text ("os error 28")."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text


_AFTER_CHECKPOINT = (
    "The partial files were removed and the previous checkpoint is intact. Free space there (or "
    "choose a training.output_dir on a larger disk) and resume with --checkpoint.resume_from "
    "auto; to write less, lower checkpoint.keep_last or set checkpoint.save_final: false"
)
AFTER_EXPORT = (
    "The partial export was removed; checkpoints are untouched. Free space there (or choose "
    "another folder) and export the last checkpoint with megatrain export --checkpoint DIR --out "
    "DIR"
)


def disk_full_error(
    folder: str | Path, what: str, needed_bytes: int, *, fix: str = _AFTER_CHECKPOINT
) -> DiskFullError:
    """The paragraph for a save that ran out of space in `folder`."""
    try:
        free = f"{_gib(free_bytes(folder))} GiB"
    except OSError:
        free = "an unknown amount"
    return DiskFullError(
        f"the disk filled while writing {what} into {folder}: it needs about "
        f"{_gib(needed_bytes)} GiB and {free} is free now. " + fix
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
