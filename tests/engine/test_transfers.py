"""Transfers: exact copies in both directions, events, and `after=` ordering.

On the CPU every copy is synchronous and returns the completed event DONE; on CUDA the copies
run on their own streams and ordering comes from events (tests marked `gpu`). A copy moves
bytes, so every comparison is bitwise (bf16 data compared as int16).
"""

from __future__ import annotations

import pytest
import torch

from megatrain.engine.transfers import DONE, Transfers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so NaN payloads and -0.0 compare exactly."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 3).to(dtype)


def test_done_is_complete_and_waiting_on_it_returns_at_once() -> None:
    assert DONE.query() is True
    assert DONE.synchronize() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_copies_are_synchronous_and_exact(dtype: torch.dtype) -> None:
    transfers = Transfers(torch.device("cpu"))
    assert not transfers.is_cuda
    src = _data(1000, dtype, seed=0)
    dst = torch.zeros(1000, dtype=dtype)
    event = transfers.h2d(dst, src)
    # complete on return: the copy happened before h2d returned, no wait needed
    assert event is DONE and event.query()
    assert torch.equal(_bits(dst), _bits(src))
    back = torch.zeros(1000, dtype=dtype)
    event = transfers.d2h(back, dst)
    assert event is DONE
    assert torch.equal(_bits(back), _bits(src))


def test_cpu_copy_into_a_prefix_leaves_the_rest() -> None:
    """What LayerSlots does: a block smaller than the slot fills only its prefix."""
    transfers = Transfers(torch.device("cpu"))
    slot = torch.full((10,), -1.0)
    transfers.h2d(slot[:6], torch.arange(6.0))
    assert slot.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0, -1.0, -1.0, -1.0]


def test_cpu_after_orders_a_chain_of_copies() -> None:
    """Each copy sees the previous one's result when given its event as `after`."""
    transfers = Transfers(torch.device("cpu"))
    a, b, c = _data(64, torch.float32, seed=1), torch.zeros(64), torch.zeros(64)
    first = transfers.h2d(b, a)
    second = transfers.d2h(c, b, after=first)
    second.synchronize()
    assert torch.equal(c, a)


def test_cpu_events_and_waits_are_no_ops() -> None:
    transfers = Transfers(torch.device("cpu"))
    assert transfers.compute_event() is DONE
    transfers.wait(None)
    transfers.wait(DONE)
    transfers.wait(transfers.compute_event())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_copies_round_trip_exactly(dtype: torch.dtype) -> None:
    transfers = Transfers(torch.device("cuda"))
    assert transfers.is_cuda
    src = _data(1 << 20, dtype, seed=2).pin_memory()
    dev = torch.empty(1 << 20, dtype=dtype, device="cuda")
    back = torch.zeros(1 << 20, dtype=dtype).pin_memory()
    ready = transfers.h2d(dev, src)
    landed = transfers.d2h(back, dev, after=ready)
    landed.synchronize()  # sync point: the host now holds the round trip
    assert landed.query()
    assert torch.equal(_bits(back), _bits(src))


@pytest.mark.gpu
def test_cuda_compute_waits_for_h2d_event() -> None:
    """Compute on the current stream after `wait(event)` reads the copied weights, not stale ones.

    The copy is large so that it is still in flight when the compute is issued; without the
    wait the compute stream would read the buffer's old contents (zeros).
    """
    transfers = Transfers(torch.device("cuda"))
    n = 1 << 26  # 256 MiB of fp32: milliseconds over PCIe
    src = torch.ones(n).pin_memory()
    dev = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    ready = transfers.h2d(dev, src)
    transfers.wait(ready)
    total = dev.sum()  # exact: n ones sum to 2**26 in fp32
    assert total.item() == float(n)  # sync point


@pytest.mark.gpu
def test_cuda_d2h_after_compute_event_sees_the_compute_result() -> None:
    """A gradient copy ordered after `compute_event()` copies what compute wrote, not before."""
    transfers = Transfers(torch.device("cuda"))
    n = 1 << 24
    x = torch.full((n,), 2.0, device="cuda")
    out = torch.zeros(n, device="cuda")
    host = torch.zeros(n).pin_memory()
    torch.cuda.synchronize()
    for _ in range(20):  # enough queued work that an unordered copy would overtake it
        out.add_(x)
    landed = transfers.d2h(host, out, after=transfers.compute_event())
    landed.synchronize()  # sync point
    assert torch.equal(host, torch.full((n,), 40.0))


@pytest.mark.gpu
def test_cuda_h2d_after_free_event_does_not_overwrite_a_slot_in_use() -> None:
    """LayerSlots' reuse rule: the next layer's copy waits for the compute reading the slot."""
    transfers = Transfers(torch.device("cuda"))
    n = 1 << 24
    slot = torch.ones(n, device="cuda")
    acc = torch.zeros(n, device="cuda")
    nxt = torch.full((n,), 5.0).pin_memory()
    torch.cuda.synchronize()
    for _ in range(20):  # the old layer's compute, still queued when the copy is issued
        acc.add_(slot)
    free = transfers.compute_event()
    ready = transfers.h2d(slot, nxt, after=free)
    transfers.wait(ready)
    assert torch.equal(acc.cpu(), torch.full((n,), 20.0))  # sync point
    assert torch.equal(slot.cpu(), torch.full((n,), 5.0))


def test_cpu_h2d_new_copies_exactly_in_the_asked_dtype() -> None:
    transfers = Transfers(torch.device("cpu"))
    src = _data(1000, torch.float32, seed=4)
    dst, event = transfers.h2d_new(src, torch.bfloat16, after=DONE)
    assert event is DONE and dst.dtype == torch.bfloat16
    assert torch.equal(_bits(dst), _bits(src.to(torch.bfloat16)))


@pytest.mark.gpu
def test_cuda_h2d_new_lands_after_compute_still_writing_its_reused_memory() -> None:
    """The embedding rows' race (docs/optimizer_states.md, "The share's NaN"): a block the
    compute stream frees while a kernel queued there still writes it is handed to the next
    allocation at once; the copy into that new tensor must land after the write, not under it."""
    transfers = Transfers(torch.device("cuda"))
    src = _data(1 << 20, torch.bfloat16, seed=3).pin_memory()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free block of this size: the next allocation is old's
    old = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued compute before the write below
    old.fill_(float("nan"))
    reused = old.data_ptr()
    del old  # back in the compute stream's pool, its fill still queued
    new, ready = transfers.h2d_new(src)
    assert new.data_ptr() == reused  # the race's setting: the same memory
    transfers.wait(ready)
    assert torch.equal(_bits(new.cpu()), _bits(src))  # sync point
