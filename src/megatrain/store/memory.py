"""Host allocations for the store: large pageable buffers on transparent huge pages.

The AdamW pass streams seven arrays per thread through memory (p, m, v, gradient in; p, m, v,
shadow out). With 4 KiB pages that is a TLB miss every 1,024 floats per stream; huge pages
(2 MiB) make those misses 512x rarer. Linux gives huge pages to anonymous mappings that ask for
them with madvise(MADV_HUGEPAGE) when transparent_hugepage is "madvise" (the common default),
so large pageable buffers are mmap'ed and advised here. Pinned buffers come from CUDA's host
allocator as before. The memory is zero-filled and touched here, at allocation, so the cost of
faulting it in is paid while the store is built, not inside the first optimizer step.

Pinned buffers (the bf16 shadows) are the same mappings, page-locked with cudaHostRegister:
CUDA's own pinned allocator, behind `torch.empty(pin_memory=True)`, rounds every block up to a
power of two (a 154 MB layer shadow takes 256 MiB: 4 GiB lost on a 3B model), registering
exactly the bytes needed wastes nothing. If registration fails the torch allocator is used.
"""

from __future__ import annotations

import mmap
import weakref

import torch

_HUGE = 2 << 20
HUGE_PAGE_MIN_BYTES = 32 << 20
"""Host buffers this large are huge-page mappings (page-locked with cudaHostRegister when
pinned); smaller ones come from torch's allocators. Below this, huge pages cannot matter."""


def host_zeros(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """A zero-filled 1-D host tensor: large ones on huge pages, page-locked if `pin`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    if not pinnable(nbytes):
        return torch.zeros(numel, dtype=dtype, pin_memory=pin)
    size = -(-nbytes // _HUGE) * _HUGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(buf, dtype=dtype, count=numel)  # keeps `buf` alive
    tensor.zero_()  # fault every page in now (the kernel zero-fills; this just touches)
    if pin and not _register(tensor, size):
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    return tensor


def pinnable(nbytes: int) -> bool:
    """Whether `pin_in_place` page-locks a store tensor of `nbytes`: the huge-page mappings
    (HUGE_PAGE_MIN_BYTES and up); smaller ones come from torch's allocator and may share a
    page with other tensors."""
    return nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE")


def pin_in_place(tensor: torch.Tensor) -> bool:
    """Page-lock an existing store tensor where it lies (engine/gpu_share.py: the share's
    master and states then cross the link at the pinned rate, and copies are asynchronous);
    True if it is pinned now. Only `pinnable` tensors, which start a mapping of their own."""
    if tensor.is_pinned():
        return True
    nbytes = tensor.numel() * tensor.element_size()
    if not pinnable(nbytes) or tensor.data_ptr() % mmap.PAGESIZE:
        return False
    return _register(tensor, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


def _register(tensor: torch.Tensor, size: int) -> bool:
    """Page-lock `tensor`'s mapping for CUDA copies; unregistered when the tensor is freed."""
    cudart = torch.cuda.cudart()
    ptr = tensor.data_ptr()
    if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:  # 0 = cudaSuccess
        return False
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
    return True
