"""bf16 master weights with stochastic rounding (store/master.py, optim/bf16_master.py).

Why stochastic rounding: tiny updates move a bf16-SR master as they move fp32 (in the mean
over elements, within a bound derived below), while a round-to-nearest bf16 master stays
frozen. The rounding itself is unbiased. The C kernel equals the torch reference bit for bit
for every state dtype, gradient format (fp32, bf16, int8 codes with units), shape and thread
count.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import num_grad_blocks, quantize_gradient_
from megatrain.store.master import MASTER_KEY
from megatrain.store.states import QUANT_BLOCK, bf16_stochastic, rounding_key

needs_kernel = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler")


def _block(
    master: torch.Tensor, decay_numel: int, state_dtype: str, grad_dtype: torch.dtype
) -> ParamBlock:
    n = master.numel()
    block = ParamBlock.with_states(
        name="layer.3", entries=[], numel=n, decay_numel=decay_numel, master=master.clone(),
        state_dtype=state_dtype,
    )  # fmt: skip
    block.grad = torch.empty(n, dtype=grad_dtype)
    if grad_dtype == torch.int8:  # held compactly: codes and one unit per GRAD_BLOCK
        block.grad_unit = torch.empty(num_grad_blocks(n))
    return block


SIZES = [
    (1, 1),  # one element
    (QUANT_BLOCK - 1, 0),  # nothing decays
    (3 * QUANT_BLOCK + 5, QUANT_BLOCK + 100),  # decay boundary inside a quantization block
    ((1 << 16) + 3 * QUANT_BLOCK + 17, 40_000),  # more than one C work chunk
]


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize(("n", "decay_numel"), SIZES)
@pytest.mark.parametrize("threads", [1, 3])
def test_c_kernel_equals_torch_reference_bit_for_bit(
    state_dtype: str, grad_dtype: torch.dtype, n: int, decay_numel: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(n, generator=gen) * 0.02).bfloat16()
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    c_block = _block(master, decay_numel, state_dtype, grad_dtype)
    ref_block = _block(master, decay_numel, state_dtype, grad_dtype)
    c_opt = CpuAdamW(hyper, impl="c", num_threads=threads)
    ref_opt = CpuAdamW(hyper, impl="torch")
    for step, scale in enumerate([1.0, 0.37, 1.0, 0.05]):
        spread = 10.0 ** torch.randint(-4, 1, (n,), generator=gen).float()
        grad = torch.randn(n, generator=gen) * spread * 10.0 ** -(2 * (step % 2))
        for block in (c_block, ref_block):
            if block.grad_unit is not None:
                quantize_gradient_(grad, block.grad, block.grad_unit, key=step)
            else:
                block.grad_landing.copy_(grad)
        c_opt.update(c_block, lr=3e-3, grad_scale=scale)
        ref_opt.update(ref_block, lr=3e-3, grad_scale=scale)
        assert c_block.master.dtype == torch.bfloat16
        assert torch.equal(c_block.master, ref_block.master), step
        for key, ours in c_block.state_tensors().items():
            assert torch.equal(ours, ref_block.state_tensors()[key]), (step, key)
    assert not torch.equal(c_block.master, master)  # the weights moved


def test_stochastic_rounding_is_unbiased() -> None:
    """E[round(x)] = x: each of M values rounded with K keys (one per step).

    Per sample, e = (round(x) - x) / ulp(x) lies in [-1, 1] (round(x) is one of x's two bf16
    neighbours), and the samples are independent draws (hashed bits) with mean 0 when the
    rounding is unbiased. Hoeffding: P(|mean of n| >= t) <= 2 exp(-n t^2 / 2); with n = M K and
    a failure probability of 1e-9, t = sqrt(2 ln(2e9) / n). Truncation (always down) would have
    mean -0.5 here; round-to-nearest is 0 on average over values but biased per value (by its
    fraction, or minus its complement, always the same), so each value's mean over its K keys
    is held too: Hoeffding over K with a failure probability of 1e-9 / M.
    """
    gen = torch.Generator().manual_seed(3)
    m, k = 256, 4096
    x = torch.rand(m, generator=gen) * 10.0 ** torch.randint(-8, 4, (m,), generator=gen).float()
    x = torch.where(torch.rand(m, generator=gen) < 0.5, -x, x)
    ulp = torch.ldexp(torch.ones(m), torch.frexp(x)[1] - 8)  # bf16: 8 significant bits
    rounded = torch.stack(
        [bf16_stochastic(x, rounding_key("layer.0", step, MASTER_KEY)).float() for step in range(k)]
    )
    assert bool(((rounded - x).abs() < ulp).all())  # always one of the two neighbours
    error = (rounded - x) / ulp  # [K, M]
    t_all = math.sqrt(2 * math.log(2e9) / (m * k))
    assert abs(float(error.mean())) <= t_all, (float(error.mean()), t_all)
    t_each = math.sqrt(2 * math.log(2 * m / 1e-9) / k)
    worst = float(error.mean(dim=0).abs().max())
    assert worst <= t_each, (worst, t_each)
    # the per-value bound is tight enough to catch rounding to nearest: its error, the same
    # every time, is uniform in [-1/2, 1/2] ulp over values, beyond t_each (~0.12) for most
    nearest = (x.bfloat16().float() - x) / ulp
    assert float((nearest.abs() > t_each).float().mean()) > 0.5


def test_tiny_updates_move_a_stochastic_bf16_master_like_fp32() -> None:
    """1e-5 relative steps: fp32 moves, bf16 with rounding to nearest is frozen, bf16-SR
    follows fp32 in the mean over elements.

    N weights start at 1.0 and see the gradient 1.0 for K steps (lr 1e-5, no decay): Adam's
    step is then the same u_t ~ lr for every element and does not depend on the weight, so
    the fp32 master moves by D = sum u_t and each SR element is a martingale with
    E[p_K] = 1 - D. Each step rounds a value within u_t of a bf16 grid point, so its variance
    is f (1 - f) ulp^2 <= u_t ulp (f the fraction above the lower neighbour, ulp <= 2^-7
    below 2.0): Var(p_K) <= ulp D. Over N independent elements the mean's standard deviation
    is sqrt(ulp D / N); bound: 6 of them, plus K fp32 roundings of p - u (2^-24 each).
    """
    n, steps, lr = 1 << 18, 200, 1e-5
    ones = torch.ones(n)
    fp32 = _block(ones, 0, "fp32", torch.bfloat16)
    sr = _block(ones.bfloat16(), 0, "fp32", torch.bfloat16)
    nearest = ones.bfloat16()
    opt = CpuAdamW(AdamWHyper(betas=(0.9, 0.999)), num_threads=2)
    for _ in range(steps):
        before = fp32.master.clone()
        for block in (fp32, sr):
            block.grad_landing.fill_(1.0)
        fp32.shadow = None  # the fp32 block's gradient lands in .grad (bf16)
        opt.update(fp32, lr=lr)
        opt.update(sr, lr=lr)
        # the same update applied to a bf16 master rounded to nearest
        nearest = (nearest.float() + (fp32.master - before)).bfloat16()
    drift = float(1.0 - fp32.master.mean())
    assert 0.9 * steps * lr < drift < 1.1 * steps * lr  # fp32 moved by ~K lr
    assert torch.equal(nearest, ones.bfloat16())  # round-to-nearest never moved
    bound = 6 * math.sqrt(2.0**-7 * drift / n) + steps * 2.0**-24
    gap = abs(float(sr.master.float().mean()) - float(fp32.master.mean()))
    assert gap <= bound, (gap, bound, drift)
    assert bound < 0.05 * drift  # the check is tight: SR tracks fp32 to a few percent
