"""Host allocations for the store: large pageable buffers on transparent huge pages.

The AdamW pass streams seven arrays per thread through memory (p, m, v, gradient in; p, m, v,
shadow out). With 4 KiB pages that is a TLB miss every 1,024 floats per stream; huge pages
(2 MiB) make those misses 512x rarer. Linux gives huge pages to anonymous mappings that ask for
them with madvise(MADV_HUGEPAGE) when transparent_hugepage is "madvise" (the common default),
so large pageable buffers are mmap'ed and advised here. Pinned buffers come from CUDA's host
allocator as before. The memory is zero-filled by the kernel, lazily, on first touch.
"""

from __future__ import annotations

import mmap

import torch

_HUGE = 2 << 20
_MIN_BYTES = 32 << 20  # below this, huge pages cannot matter


def host_zeros(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """A zero-filled 1-D host tensor; pinned, or pageable on huge pages when large."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if pin or nbytes < _MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype, pin_memory=pin)
    size = -(-nbytes // _HUGE) * _HUGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype, count=numel)  # keeps `buf` alive
