"""Held gradients of a bf16 master (store/grads.py): the int8 format with stochastic rounding,
its place in the device staging buffer, the shared landings when clipping is off, and the
bytes per parameter each hold costs."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from megatrain.store.grads import (
    GRAD_BLOCK,
    GRAD_CHUNK,
    INT8_LEVELS,
    LandingPool,
    dequantize_gradient,
    gradient_hold,
    hold_buffers,
    int8_views,
    num_grad_blocks,
    pool_buffers,
    quantize_gradient_,
)
from megatrain.store.master import weight_bytes_per_param


def _quantize(x: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.numel(), dtype=torch.int8)
    units = torch.empty(num_grad_blocks(x.numel()))
    quantize_gradient_(x, codes, units, key)
    return codes, units


def _gradient(n: int, seed: int = 0) -> torch.Tensor:
    """Values over 5 decades and a zero block: the shapes a layer's gradient takes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, -1, (n,), generator=gen)
    x[GRAD_BLOCK : 2 * GRAD_BLOCK] = 0.0  # a block of zeros: unit 0, codes 0
    return x


def test_int8_codes_units_and_error_bound() -> None:
    """unit = block absmax / 127 (one fp32 division); codes in [-127, 127]; each value read
    back (code x unit) is within one unit of it: floor(x / unit + u) is one of the two codes
    around x / unit, up to the roundings of the division, the addition of u (at most 2^-17 of
    a unit at |x / unit| <= 128) and the product (2^-24 of |x|)."""
    n = 3 * GRAD_BLOCK + 77
    x = _gradient(n)
    codes, units = _quantize(x, key=7)
    padded = torch.nn.functional.pad(x, (0, (-n) % GRAD_BLOCK)).view(-1, GRAD_BLOCK)
    assert torch.equal(units, padded.abs().amax(dim=1) / INT8_LEVELS)
    assert int(codes.abs().max()) <= INT8_LEVELS
    back = dequantize_gradient(codes, units, 0, n)
    unit = units[torch.arange(n) // GRAD_BLOCK]
    bound = unit * (1 + 2.0**-16) + x.abs() * 2.0**-24
    assert bool(((back - x).abs() <= bound).all())
    assert torch.equal(back[GRAD_BLOCK : 2 * GRAD_BLOCK], torch.zeros(GRAD_BLOCK))
    again, _ = _quantize(x, key=7)
    assert torch.equal(again, codes)  # the same key draws the same bits
    other, _ = _quantize(x, key=8)
    assert not torch.equal(other, codes)


def test_int8_rounding_is_unbiased() -> None:
    """E[code x unit] = x. K independent keys; each reading lies in an interval two units wide
    around x, so by Hoeffding the mean of K deviates from its expectation by more than
    t = 2 unit sqrt(ln(2 N / p) / (2 K)) with probability below p = 1e-9 over all N values.
    Rounding to nearest would miss by up to half a unit (the values below have every fraction
    of a unit), more than t; the bias left by float rounding is below 2^-16 units."""
    n, k = 2 * GRAD_BLOCK, 400
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(n, generator=gen) * 2 - 1
    x[0] = 1.0  # every block's absmax is 1: unit = 1 / 127 everywhere
    x[GRAD_BLOCK] = -1.0
    total = torch.zeros(n, dtype=torch.float64)
    for key in range(k):
        codes, units = _quantize(x, key)
        total += dequantize_gradient(codes, units, 0, n).double()
    unit = 1.0 / INT8_LEVELS
    t = 2 * unit * math.sqrt(math.log(2 * n / 1e-9) / (2 * k))
    assert t < 0.5 * unit  # the test can tell stochastic from nearest rounding
    assert float((total / k - x.double()).abs().max()) <= t + unit * 2.0**-16
    nearest = torch.round(x / unit) * unit
    assert float((nearest - x).abs().max()) > t


def test_chunks_and_tails() -> None:
    """A gradient longer than one device pass (GRAD_CHUNK) with a partial last block: every
    block's unit is its own absmax / 127, the last one over the values that exist."""
    n = GRAD_CHUNK + GRAD_BLOCK + 5
    x = torch.zeros(n)
    x[-5:] = torch.tensor([3.0, -1.0, 0.5, 0.25, 2.0])
    x[GRAD_CHUNK - 1] = -4.0
    codes, units = _quantize(x, key=3)
    assert units[-1] == 3.0 / INT8_LEVELS and codes[-5] == INT8_LEVELS
    assert units[GRAD_CHUNK // GRAD_BLOCK - 1] == 4.0 / INT8_LEVELS
    assert codes[GRAD_CHUNK - 1] == -INT8_LEVELS


@pytest.mark.parametrize("n", [1, 5, 2047, GRAD_BLOCK + 1, 10 * GRAD_BLOCK])
def test_int8_views_fit_the_bf16_stage(n: int) -> None:
    """Codes then fp32-aligned units inside the 2n bytes of a bf16 staging buffer, apart; a
    block too small for both gets buffers of its own."""
    stage = torch.zeros(n, dtype=torch.bfloat16)
    codes, units = int8_views(stage)
    assert codes.numel() == n and units.numel() == num_grad_blocks(n)
    if codes.untyped_storage().data_ptr() == stage.untyped_storage().data_ptr():
        assert units.data_ptr() % 4 == 0
        assert codes.data_ptr() + n <= units.data_ptr()
        assert units.data_ptr() + 4 * units.numel() <= stage.data_ptr() + 2 * n
    codes.fill_(-1)
    units.fill_(2.0)
    assert torch.equal(codes, torch.full((n,), -1, dtype=torch.int8))


def test_bytes_per_parameter_of_each_hold() -> None:
    """bf16 master + bf16 landing 4 B/param; + int8 landing 3.002; clipping off 2 (the pool is
    the store's: two landings of its largest block)."""
    assert weight_bytes_per_param("bf16", grad_hold="bf16") == 4
    assert weight_bytes_per_param("bf16", grad_hold="int8") == pytest.approx(3 + 4 / GRAD_BLOCK)
    assert weight_bytes_per_param("bf16", grad_hold="pool") == 2
    assert hold_buffers(10, "shadow") == [] and pool_buffers([3, 9, 4], "pool") == [18, 18]
    assert pool_buffers([3, 9], "int8") == []
    assert gradient_hold("fp32", "int8", clipping=True) == "shadow"
    assert gradient_hold("bf16", "int8", clipping=True) == "int8"
    assert gradient_hold("bf16", "int8", clipping=False) == "pool"
    assert gradient_hold("fp32", "bf16", clipping=True, bf16_compute=False) == "fp32"


def test_landing_pool_waits_for_a_free_landing() -> None:
    pool = LandingPool(8, pin=False, count=1)
    first = pool.take(5)
    assert first.numel() == 5
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(8)))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # both landings taken: the backward waits
    pool.give(first)
    waiter.join(timeout=5)
    assert len(got) == 1 and got[0].numel() == 8
