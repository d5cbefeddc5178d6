"""Compressed AdamW states: the C kernel equals the plain-PyTorch reference bit for bit on any
thread count, and the reference is AdamW on dequantized states (checked against a float64 AdamW
step). int4's own checks (thread counts, midpoints, round trip) are in
test_optim_states_int4.py."""

from __future__ import annotations

import pytest
import torch

from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.int4 import dequantize_int4
from megatrain.store.states import (
    QUANT_BLOCK,
    allocate_states,
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
    quantize_table,
)
from state_blocks import host_block as _block
from state_blocks import spread_grad as _grad

needs_kernel = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler")


SIZES = [
    (1, 1),  # one element
    (QUANT_BLOCK - 1, 0),  # nothing decays
    (QUANT_BLOCK, QUANT_BLOCK),  # everything decays
    (3 * QUANT_BLOCK + 5, QUANT_BLOCK + 100),  # decay boundary inside a quantization block
    ((1 << 16) + 3 * QUANT_BLOCK + 17, 40_000),  # more than one C work chunk
]


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("bf16_grads", [False, True])
@pytest.mark.parametrize(("n", "decay_numel"), SIZES)
def test_c_kernel_equals_torch_reference_bit_for_bit(
    state_dtype: str, bf16_grads: bool, n: int, decay_numel: int
) -> None:
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    c_block = _block(n, decay_numel, state_dtype, bf16_grads)
    ref_block = _block(n, decay_numel, state_dtype, bf16_grads)
    c_opt = CpuAdamW(hyper, impl="c", num_threads=3)
    ref_opt = CpuAdamW(hyper, impl="torch")
    gen = torch.Generator().manual_seed(1)
    for step, scale in enumerate([1.0, 0.37, 1.0, 0.05, 1.0]):
        grad = _grad(n, step, gen)
        for block in (c_block, ref_block):
            block.grad_landing.copy_(grad)
        c_opt.update(c_block, lr=3e-3, grad_scale=scale)
        ref_opt.update(ref_block, lr=3e-3, grad_scale=scale)
        assert torch.equal(c_block.master, ref_block.master)
        for key, ours in c_block.state_tensors().items():
            assert torch.equal(ours, ref_block.state_tensors()[key]), key
        if c_block.shadow is not None:
            assert ref_block.shadow is not None
            assert torch.equal(c_block.shadow, ref_block.shadow)
            assert torch.equal(c_block.shadow, c_block.master.bfloat16())


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_c_kernel_is_independent_of_thread_count(state_dtype: str) -> None:
    """The same states bit for bit on 1, 2 or 5 threads over several work chunks: each element's
    update is its own, the stochastic rounding's bits come from the element's index and the int8
    block maximum is exact, so the host AdamW's thread count may follow the machine's load
    (megatrain/threads.py) without changing a run's losses."""
    n, decay_numel = 2 * (1 << 16) + 3 * QUANT_BLOCK + 17, 100_000
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    results = []
    for threads in (1, 2, 5):
        block = _block(n, decay_numel, state_dtype, bf16_grads=True)
        opt = CpuAdamW(hyper, impl="c", num_threads=threads)
        gen = torch.Generator().manual_seed(4)
        for step, scale in enumerate([1.0, 0.37, 1.0]):
            block.grad_landing.copy_(_grad(n, step, gen))
            opt.update(block, lr=3e-3, grad_scale=scale)
        results.append([block.master, block.grad_landing, *block.state_tensors().values()])
    for other in results[1:]:
        for ours, theirs in zip(results[0], other, strict=True):
            assert torch.equal(ours, theirs)


def _dequantized(block: ParamBlock) -> tuple[torch.Tensor, torch.Tensor]:
    if block.state_dtype == "bf16":
        return block.exp_avg.double(), block.exp_avg_sq.double()
    assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
    if block.state_dtype == "int4":
        return (
            dequantize_int4(block.exp_avg, block.exp_avg_scale, block.numel, signed=True).double(),
            dequantize_int4(
                block.exp_avg_sq, block.exp_avg_sq_scale, block.numel, signed=False
            ).double(),
        )
    return (
        dequantize_blockwise(block.exp_avg, block.exp_avg_scale, signed=True).double(),
        dequantize_blockwise(block.exp_avg_sq, block.exp_avg_sq_scale, signed=False).double(),
    )


@pytest.mark.parametrize("impl", ["torch"] + (["c"] if load_adamw_kernel() else []))
@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4"])
def test_update_is_adamw_on_the_dequantized_states(impl: str, state_dtype: str) -> None:
    """One step from the stored states equals a float64 AdamW step from their dequantized
    values, to float32 rounding: the compression only rounds what is stored."""
    n, decay_numel, lr, wd, scale = 3 * QUANT_BLOCK + 77, 2_500, 1e-3, 0.1, 0.5
    hyper = AdamWHyper(betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    block = _block(n, decay_numel, state_dtype, bf16_grads=False)
    opt = CpuAdamW(hyper, impl=impl, num_threads=2)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        block.grad_landing.copy_(_grad(n, step, gen))
        opt.update(block, lr=lr, grad_scale=1.0)
    p0 = block.master.double()
    m0, v0 = _dequantized(block)
    grad = _grad(n, 3, gen)
    block.grad_landing.copy_(grad)
    opt.update(block, lr=lr, grad_scale=scale)
    g = grad.double() * scale
    m = 0.9 * m0 + 0.1 * g
    v = 0.999 * v0 + 0.001 * g * g
    denom = (v / (1 - 0.999**4)).sqrt() + 1e-8
    decay = torch.ones(n, dtype=torch.float64)
    decay[:decay_numel] = 1 - lr * wd
    expected = p0 * decay - lr / (1 - 0.9**4) * m / denom
    # Each float32 op and each float32 constant is within 2^-24 relative. m = m0 + 0.1(g - m0)
    # may cancel, so its error is bounded by its terms: ~4 roundings of |m0| + 0.1|g|; v has
    # no cancellation (non-negative terms), and sqrt, / bc2, + eps, m / denom, x step_size add
    # <= 8 roundings relative to the step; p * decay - step: 3 roundings of |p| (decay's float32
    # constant included).
    update = lr / (1 - 0.9**4) / denom
    tol = 2**-24 * (3 * p0.abs() + update * (4 * (m0.abs() + 0.1 * g.abs()) + 8 * m.abs()))
    assert bool(((block.master.double() - expected).abs() <= tol).all())


@pytest.mark.parametrize("signed", [True, False])
def test_blockwise_round_trip_is_the_nearest_map_value(signed: bool) -> None:
    n = 5 * QUANT_BLOCK + 123
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 2, (n,), generator=gen).float()
    x[QUANT_BLOCK : 2 * QUANT_BLOCK] = 0.0  # an all-zero block
    x[-1] = -x.abs().max() * 3  # a block whose absmax is a negative value
    if not signed:
        x = x.abs()
    codes, absmax = quantize_blockwise(x, signed=signed)
    assert codes.dtype == torch.uint8 and absmax.numel() == -(-n // QUANT_BLOCK)
    back = dequantize_blockwise(codes, absmax, signed=signed)

    qmap = dynamic_map(signed)[0].double()
    scale = absmax.double().repeat_interleave(QUANT_BLOCK)[:n]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x.double() / safe  # the normalised value, in [-1, 1]
    nearest = (qmap[None, :] - y[:, None]).abs().min(dim=1).values
    picked = (qmap[codes.long()] - y).abs()
    # midpoints are rounded to float32 (2^-24 relative) and so is x / absmax
    assert bool((picked <= nearest + 2**-23 * y.abs() + 2**-40).all())
    # the round trip: within the distance to the nearest map value, plus the product's rounding
    err = (back.double() - x.double()).abs()
    assert bool((err <= scale * (nearest + 2**-23 * y.abs()) + 2**-24 * x.abs().double()).all())
    # what that means in numbers: half the widest map gap (the top decade, 0.9 / 64 signed and
    # 0.9 / 128 unsigned, and the asymmetric end of the signed map at -0.993)
    half_gap = 0.9 / 64 / 2 if signed else 0.9 / 128 / 2
    assert bool((err <= scale * (half_gap + 1e-6)).all())
    assert bool((back[QUANT_BLOCK : 2 * QUANT_BLOCK] == 0).all())


def test_fresh_int8_states_dequantize_to_zero() -> None:
    states = allocate_states(QUANT_BLOCK + 1, "int8")
    assert states["exp_avg"].dtype == torch.uint8 and states["exp_avg_scale"].numel() == 2
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        back = dequantize_blockwise(states[key], states[f"{key}_scale"], signed=signed)
        assert bool((back == 0).all())


@pytest.mark.parametrize("signed", [True, False])
def test_the_kernels_lookup_is_searchsorted(signed: bool) -> None:
    """csrc/adamw.c `quantize`, its integer steps done here on `quantize_table`, picks the code
    torch.searchsorted picks (the number of midpoints below x) at every midpoint, at the floats
    either side of each, at +-0 and +-inf, and at 2^20 floats of random bit patterns (every
    exponent of both signs): an exact comparison, no tolerance."""
    mids = dynamic_map(signed)[1]
    inf = torch.tensor(float("inf"))
    gen = torch.Generator().manual_seed(5)
    patterns = torch.randint(0, 1 << 32, (1 << 20,), generator=gen, dtype=torch.int64)
    spread = torch.where(patterns >= 1 << 31, patterns - (1 << 32), patterns).to(torch.int32)
    x = torch.cat(
        [
            mids,
            torch.nextafter(mids, inf),
            torch.nextafter(mids, -inf),
            torch.tensor([0.0, -0.0, float("inf"), float("-inf")]),
            spread.view(torch.float32).nan_to_num(nan=0.5),
        ]
    )
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    entry = quantize_table(signed).to(torch.int64)[u >> 16] & 0xFFFFFFFF
    low, mid = u & 0xFFFF, entry >> 16
    above = torch.where(u >> 31 == 1, low < mid, low > mid).to(torch.int64)
    code = (entry & 0xFF) + ((entry >> 8) & 1) * above
    assert torch.equal(code, torch.searchsorted(mids, x))
