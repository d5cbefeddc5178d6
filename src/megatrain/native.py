"""Build and load the C kernels (csrc/adamw.c: fused AdamW, bf16 cast) on first use, cached per
machine. A leaf module: the optimizer and the store both use it, it imports nothing of theirs.

Compiled with the system C compiler and OpenMP into ~/.cache/megatrain/kernels/<key>/, where the
key hashes the source, the compiler and the CPU, so a cache shared between machines never hands
one machine's -march=native build to another. The build writes to a temporary name and renames
it into place: a crash mid-build never leaves a broken library under the final name. Returns
None (and the optimizer falls back to torch, with a warning) when no compiler is available, the
build fails, or the built kernel fails its self-test.

Exactness: every element is computed by the same sequence of IEEE fp32 operations whatever the
vector width (SSE, AVX2, AVX-512) or thread count: -fno-fast-math keeps the compiler from
reassociating or using approximate reciprocals and square roots, -ffp-contract=off from fusing
a multiply and an add into an FMA (which rounds once instead of twice). Each +, -, *, / and
sqrtf is then correctly rounded, so the result is bit-identical to the same operations done one
by one in torch fp32 (`reference_step`). The self-test checks exactly that on values that
exercise every branch, so a compiler that ignores the flags is caught before the first update.
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

import numpy as np
import torch

_SRC = Path(__file__).resolve().parent / "csrc" / "adamw.c"
_FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-fast-math",
    "-fno-math-errno",  # sqrtf without the errno branch: vectorizes; results are identical
    "-ffp-contract=off",
    "-fPIC",
    "-shared",
]


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
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:  # e.g. a stale cache entry for a different libgomp
        warnings.warn(
            f"could not load the C AdamW kernel {target}, using torch: {err}", stacklevel=2
        )
        return None
    _declare(lib)
    if not self_test(lib):
        warnings.warn(
            f"the C AdamW kernel built by {compiler} differs from IEEE fp32 arithmetic (does the "
            "compiler ignore -fno-fast-math / -ffp-contract=off?); using torch",
            stacklevel=2,
        )
        return None
    return lib


def reference_step(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    decay: float,
    beta2: float,
    one_minus_b1: float,
    one_minus_b2: float,
    step_size: float,
    bc2_sqrt: float,
    eps: float,
    grad_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """csrc/adamw.c's arithmetic as single fp32 numpy operations, in its order: (p, m, v) new.

    numpy, not torch: torch divides by a scalar as a multiplication by its reciprocal, which
    rounds twice; numpy's elementwise operations round once each, as the C code's do.
    """
    f32 = np.float32
    pn, mn, vn, gn = (t.float().numpy() for t in (p, m, v, g))
    gi = gn * f32(grad_scale)
    pi = pn * f32(decay)
    mi = mn + f32(one_minus_b1) * (gi - mn)
    vi = vn * f32(beta2) + (f32(one_minus_b2) * gi) * gi
    denom = np.sqrt(vi) / f32(bc2_sqrt) + f32(eps)
    pi = pi - f32(step_size) * (mi / denom)
    return torch.from_numpy(pi), torch.from_numpy(mi), torch.from_numpy(vi)


def self_test(lib: ctypes.CDLL) -> bool:
    """The kernel's update equals `reference_step` bit for bit (fp32 and bf16 gradients)."""
    gen = torch.Generator().manual_seed(0)
    n = 3 * 1024 + 5  # a vector tail on every vector width
    scale = 10.0 ** torch.randint(-6, 3, (n,), generator=gen).float()
    p0, m0 = torch.randn(n, generator=gen) * scale, torch.randn(n, generator=gen) * scale
    v0, g0 = torch.rand(n, generator=gen) * scale**2, torch.randn(n, generator=gen) * scale
    consts = dict(
        decay=0.9997, beta2=0.95, one_minus_b1=0.1, one_minus_b2=0.05,
        step_size=3.3e-3, bc2_sqrt=0.31, eps=1e-8, grad_scale=0.37,
    )  # fmt: skip
    for g in (g0, g0.bfloat16()):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        shadow = torch.empty(n, dtype=torch.bfloat16)
        lib.mt_adamw(
            p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), int(g.dtype == torch.bfloat16),
            shadow.data_ptr(), n, *consts.values(), 2,
        )  # fmt: skip
        expected = reference_step(p0, m0, v0, g, **consts)
        if not all(torch.equal(a, b) for a, b in zip((p, m, v), expected, strict=True)):
            return False
        if not torch.equal(shadow, expected[0].bfloat16()):
            return False
    return True


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
    u32, hyper = ctypes.c_uint32, [f, f, f, f, f, f, f, f]  # decay ... grad_scale
    lib.mt_adamw_bf16.argtypes = [vp, vp, vp, vp, i32, vp, i64, i64, *hyper, u32, u32, i32]
    lib.mt_adamw_bf16.restype = None
    lib.mt_adamw_int8.argtypes = [vp, vp, vp, vp, vp, vp, i32, vp, i64, i64, *hyper]
    lib.mt_adamw_int8.argtypes += [vp, vp, vp, vp, i32]
    lib.mt_adamw_int8.restype = None
    # bf16 master weights (optim/bf16_master.py): p, m, v ..., then the keys of p (m, v)
    lib.mt_adamw_bf16m_fp32.argtypes = [vp, vp, vp, vp, i32, vp, i64, i64, *hyper, u32, i32]
    lib.mt_adamw_bf16m_fp32.restype = None
    lib.mt_adamw_bf16m_bf16.argtypes = [vp, vp, vp, vp, i32, vp, i64, i64, *hyper]
    lib.mt_adamw_bf16m_bf16.argtypes += [u32, u32, u32, i32]
    lib.mt_adamw_bf16m_bf16.restype = None
    lib.mt_adamw_bf16m_int8.argtypes = [vp, vp, vp, vp, vp, vp, i32, vp, i64, i64, *hyper]
    lib.mt_adamw_bf16m_int8.argtypes += [vp, vp, vp, vp, u32, i32]
    lib.mt_adamw_bf16m_int8.restype = None
    lib.mt_adamw_int4.argtypes = [vp, vp, vp, vp, vp, vp, i32, vp, i64, i64, *hyper]
    lib.mt_adamw_int4.argtypes += [vp, vp, i32]
    lib.mt_adamw_int4.restype = None
    lib.mt_adamw_bf16m_int4.argtypes = [vp, vp, vp, vp, vp, vp, i32, vp, i64, i64, *hyper]
    lib.mt_adamw_bf16m_int4.argtypes += [vp, vp, u32, i32]
    lib.mt_adamw_bf16m_int4.restype = None
