"""4-bit AdamW states (store/int4.py): the C kernel equals the torch reference bit for bit on
any thread count, picks the nearest map value where the choice is closest (at the midpoints),
the round trip is within half a map gap, and v never rounds to zero."""

from __future__ import annotations

import pytest
import torch

from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.int4 import (
    INT4_BLOCK,
    dequantize_int4,
    int4_codes,
    int4_map,
    int4_nbytes,
    quantize_int4,
)
from megatrain.store.states import allocate_states, state_bytes_per_param

needs_kernel = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler")


def _block(master: torch.Tensor, decay_numel: int, bf16_grads: bool) -> ParamBlock:
    n = master.numel()
    block = ParamBlock.with_states(
        name="layer.3", entries=[], numel=n, decay_numel=decay_numel, master=master.clone(),
        state_dtype="int4",
    )  # fmt: skip
    if bf16_grads:
        block.shadow = torch.empty(n, dtype=torch.bfloat16)
    else:
        block.grad = torch.empty(n)
    return block


def _same(a: ParamBlock, b: ParamBlock) -> bool:
    states = all(torch.equal(t, b.state_tensors()[k]) for k, t in a.state_tensors().items())
    shadow = a.shadow is None or (b.shadow is not None and torch.equal(a.shadow, b.shadow))
    return states and shadow and torch.equal(a.master, b.master)


@needs_kernel
@pytest.mark.parametrize("bf16_grads", [False, True])
@pytest.mark.parametrize(
    ("n", "decay_numel"),
    [
        (INT4_BLOCK // 2 + 1, 3),  # one partial block: its high half partly empty
        (5 * INT4_BLOCK + 77, 2 * INT4_BLOCK + 40),  # decay boundary inside a block
        ((1 << 16) + 9 * INT4_BLOCK + 3, 70_000),  # more than one C work chunk
    ],
)
def test_kernel_equals_reference_at_every_thread_count(
    bf16_grads: bool, n: int, decay_numel: int
) -> None:
    """Each quantization block is updated whole by one thread, so the kernel's result does not
    depend on the thread count: 1, 2, 3 and 4 threads and the reference agree bit for bit."""
    hyper = AdamWHyper(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen) * 0.02
    ref = _block(master, decay_numel, bf16_grads)
    kernels = {t: _block(master, decay_numel, bf16_grads) for t in (1, 2, 3, 4)}
    opts = {t: CpuAdamW(hyper, impl="c", num_threads=t) for t in kernels}
    ref_opt = CpuAdamW(hyper, impl="torch")
    for step in range(4):
        spread = 10.0 ** torch.randint(-5, 1, (n,), generator=gen).float()
        grad = torch.randn(n, generator=gen) * spread * 10.0 ** -(2 * (step % 2))
        for block in (ref, *kernels.values()):
            block.grad_landing.copy_(grad)
        ref_opt.update(ref, lr=1e-3, grad_scale=0.8)
        for t, block in kernels.items():
            opts[t].update(block, lr=1e-3, grad_scale=0.8)
            assert _same(block, ref), (step, t)


@needs_kernel
def test_kernel_picks_the_reference_codes_at_the_midpoints() -> None:
    """Values exactly at each map midpoint and one float either side, +-0 and the map values:
    where rounding to the nearest is decided by the last bit. With beta1 = beta2 = 0 and fresh
    states one step stores m = g and v = g * g; a 1.0 in every block makes its absmax 1, so the
    normalised m is g itself."""
    hyper = AdamWHyper(betas=(0.0, 0.0), eps=1e-8, weight_decay=0.0)
    inf = torch.tensor(float("inf"))
    probes = []
    for signed in (True, False):
        qmap, mids = int4_map(signed)
        probes += [mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), qmap]
    # v = g * g: g around the square roots of v's midpoints, some squaring to them exactly
    root = torch.sqrt(int4_map(False)[1])
    for _ in range(4):
        probes += [root, -root]
        root = torch.nextafter(root, inf)
    values = torch.cat([*probes, torch.tensor([0.0, -0.0, -1.0])])
    values = values[values.abs() <= 1]
    per_block = INT4_BLOCK - 1
    blocks = -(-values.numel() // per_block)
    rest = torch.zeros(blocks * per_block)
    rest[: values.numel()] = values
    grad = torch.cat([torch.ones(blocks, 1), rest.view(blocks, per_block)], dim=1).view(-1)
    c_block, ref = (_block(torch.zeros_like(grad), 0, False) for _ in range(2))
    for block, impl in ((c_block, "c"), (ref, "torch")):
        block.grad_landing.copy_(grad)
        CpuAdamW(hyper, impl=impl, num_threads=2).update(block, lr=1e-3)
    assert _same(c_block, ref)
    assert ref.exp_avg_scale is not None
    assert torch.equal(ref.exp_avg_scale, torch.ones(blocks))
    # and the reference's codes are the nearest map values' (searchsorted on the midpoints)
    qmap, mids = int4_map(True)
    codes = int4_codes(ref.exp_avg, grad.numel())
    assert torch.equal(codes, torch.searchsorted(mids, grad))


def _half_gaps(signed: bool) -> torch.Tensor:
    """Per code, half the larger gap to its neighbours: the furthest a value rounding to that
    code can be from it (for the extreme codes, the distance to the end of [-1, 1] or [0, 1])."""
    qmap = int4_map(signed)[0].double()
    low_end = torch.tensor([-1.0 if signed else 0.0], dtype=torch.float64)
    padded = torch.cat([low_end - (qmap[0] - low_end), qmap, torch.tensor([1.0])])
    below, above = (padded[1:-1] - padded[:-2]) / 2, (padded[2:] - padded[1:-1]) / 2
    below[0] = qmap[0] - low_end[0]  # nothing rounds from beyond the end of the range
    return torch.maximum(below, above)


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_within_half_a_map_gap(signed: bool) -> None:
    n = 9 * INT4_BLOCK + 50  # a partial last block
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 2, (n,), generator=gen).float()
    x[INT4_BLOCK : 2 * INT4_BLOCK] = 0.0  # an all-zero block
    x[-1] = -x.abs().max() * 3  # a block whose absmax is a negative value
    if not signed:
        x = x.abs()
    packed, absmax = quantize_int4(x, signed=signed)
    assert packed.numel() == 10 * INT4_BLOCK // 2 and absmax.numel() == 10
    back = dequantize_int4(packed, absmax, n, signed=signed)
    codes = int4_codes(packed, n)
    scale = absmax.double().repeat_interleave(INT4_BLOCK)[:n]
    # the bound: half the gap on the side the value came from, times the absmax; plus x's
    # normalisation and the product map value x absmax (one float32 rounding each, 2^-24)
    bound = _half_gaps(signed)[codes] * scale + 2**-23 * x.abs().double() + 2**-24 * scale
    err = (back.double() - x.double()).abs()
    assert bool((err <= bound).all())
    # in numbers: m within 0.1125 of its block's absmax (the widest gap, 0.4375..0.6625, and
    # -absmax coming back as -0.8875), v within 1/16 (0 comes back as 1/16 of the absmax)
    assert bool((err <= scale * ((0.1125 if signed else 0.0625) + 2**-21)).all())
    assert bool((back[INT4_BLOCK : 2 * INT4_BLOCK] == 0).all())


def test_v_never_rounds_to_zero() -> None:
    """Li et al.'s zero-point problem: a v stored as 0 under an m that is not makes the update
    m / (sqrt(v) + eps) explode. v's map has no 0: in a block whose largest v is a, every v
    comes back as at least a / 16, so sqrt(v) >= sqrt(a) / 4."""
    v = torch.tensor([1.0, 1e-12, 0.0, 1e-3] + [0.5] * (INT4_BLOCK - 4))
    packed, absmax = quantize_int4(v, signed=False)
    back = dequantize_int4(packed, absmax, v.numel(), signed=False)
    assert bool((back >= 1.0 / 16).all()) and back[0] == 1.0


def test_layout_bytes_and_fresh_states() -> None:
    """Two codes a byte and one fp32 absmax per 128 values, per state: 1 + 8/128 B/param."""
    assert state_bytes_per_param("int4") == 1 + 8 / 128
    assert int4_nbytes(1) == 2 * (64 + 4) and int4_nbytes(129) == 4 * (64 + 4)
    states = allocate_states(INT4_BLOCK + 1, "int4")
    assert states["exp_avg"].numel() == INT4_BLOCK and states["exp_avg_sq_scale"].numel() == 2
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        back = dequantize_int4(states[key], states[f"{key}_scale"], INT4_BLOCK + 1, signed=signed)
        assert bool((back == 0).all())
