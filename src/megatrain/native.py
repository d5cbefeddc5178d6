"""Build and load the C kernels (csrc/adamw.c: fused AdamW, bf16 cast) on first use, cached per
machine. A leaf module: the optimizer and the store both use it, it imports nothing of theirs.

Compiled with the system C compiler and OpenMP into ~/.cache/megatrain/kernels/<key>/, where the
key hashes the source, the compiler and the CPU, so a cache shared between machines never hands
one machine's -march=native build to another. The build writes to a temporary name and renames
it into place: a crash mid-build never leaves a broken library under the final name. Returns
None (and the optimizer falls back to torch) when no compiler is available.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

_SRC = Path(__file__).resolve().parent / "csrc" / "adamw.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared"]


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("MEGATRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatrain"
    )
    return Path(root) / "kernels"


@cache
def load_adamw_kernel() -> ctypes.CDLL | None:
    if os.environ.get("MEGATRAIN_NO_C_KERNEL"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    key = hashlib.sha256(
        "\n".join(
            [_SRC.read_text(), compiler, version, " ".join(_FLAGS), platform.machine(), _cpu_id()]
        ).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / key / "libmtadamw.so"
    if not target.exists() and not _build(compiler, target):
        return None
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    return lib


def _build(compiler: str, target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *_FLAGS, str(_SRC), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            warnings.warn(
                f"could not build the C AdamW kernel, using torch:\n{result.stderr}", stacklevel=3
            )
            return False
        os.replace(tmp, target)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    f, i64, i32, vp = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.mt_adamw.argtypes = [vp, vp, vp, vp, i32, vp, i64, f, f, f, f, f, f, f, f, i32]
    lib.mt_adamw.restype = None
    lib.mt_to_bf16.argtypes = [vp, vp, i64, i32]
    lib.mt_to_bf16.restype = None
