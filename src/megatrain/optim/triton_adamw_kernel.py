"""The Triton kernel of optim/triton_adamw.py (imported only where Triton is installed).

One program updates BLOCK (= QUANT_BLOCK) consecutive values: for int8 states that is one
quantization block, whose new absmax the program reduces before writing its codes, as
csrc/adamw.c's mt_adamw_int8 does per block. The arithmetic follows the C kernel's ADAMW_ELEMENT
line by line; see optim/triton_adamw.py for why it is bit for bit the same.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lowbias32(x):
    """store/states.py lowbias32 on uint32 lanes (products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _bf16_stochastic(x, index, key):
    """csrc/adamw.c bf16_round_stochastic(x, lowbias32(lo32(i) ^ lowbias32(key ^ hi32(i))))."""
    inner = _lowbias32(key ^ (index >> 32).to(tl.uint32))
    bits = _lowbias32(index.to(tl.uint32) ^ inner)
    u = x.to(tl.uint32, bitcast=True)
    magnitude = u & 0x7FFFFFFF
    special = (u >> 16) | tl.where(magnitude > 0x7F800000, 0x40, 0).to(tl.uint32)
    rounded = tl.where(magnitude >= 0x7F800000, special, (u + (bits >> 16)) >> 16)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_nearest(x):
    """csrc/adamw.c bf16_round: round to nearest even, NaN kept quiet. In integer operations,
    not a cast: Triton's interpreter (the CPU tests) truncates a float32 -> bfloat16 cast."""
    u = x.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = tl.where(nan, (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize(table_ptr, x):
    """csrc/adamw.c `quantize`: the code of x (already divided by its block's absmax)."""
    u = x.to(tl.uint32, bitcast=True)
    e = tl.load(table_ptr + (u >> 16)).to(tl.uint32, bitcast=True)
    low = u & 0xFFFF
    mid = e >> 16
    above = tl.where((u >> 31) != 0, low < mid, low > mid)
    return ((e & 0xFF) + ((e >> 8) & 1) * above.to(tl.uint32)).to(tl.uint8)


@triton.jit
def adamw_fused(  # type: ignore[no-untyped-def]  # Triton reads the constexpr annotations
    p_ptr,
    m_ptr,
    v_ptr,
    m_scale_ptr,
    v_scale_ptr,
    g_ptr,
    shadow_ptr,
    map_m_ptr,
    table_m_ptr,
    map_v_ptr,
    table_v_ptr,
    n,
    decay_end,
    decay,
    beta2,
    one_minus_b1,
    one_minus_b2,
    step_size,
    bc2_sqrt,
    eps,
    grad_scale,
    key_m,
    key_v,
    STATE: tl.constexpr,  # 0 fp32, 1 bf16 (stochastic rounding), 2 int8 (blockwise codes)
    G_BF16: tl.constexpr,
    SHADOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    index = block * BLOCK + tl.arange(0, BLOCK)
    live = index < n
    g = tl.load(g_ptr + index, mask=live, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + index, mask=live, other=0.0)
    if STATE == 2:
        m_old = tl.load(map_m_ptr + tl.load(m_ptr + index, mask=live, other=0).to(tl.int32))
        v_old = tl.load(map_v_ptr + tl.load(v_ptr + index, mask=live, other=0).to(tl.int32))
        m_old = m_old * tl.load(m_scale_ptr + block)
        v_old = v_old * tl.load(v_scale_ptr + block)
    else:
        m_old = tl.load(m_ptr + index, mask=live, other=0.0).to(tl.float32)
        v_old = tl.load(v_ptr + index, mask=live, other=0.0).to(tl.float32)
    g = g * grad_scale
    p = tl.where(index < decay_end, p * decay, p)
    m = m_old + one_minus_b1 * (g - m_old)
    v = v_old * beta2 + one_minus_b2 * g * g
    denom = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)
    tl.store(p_ptr + index, p, mask=live)
    if SHADOW:
        tl.store(shadow_ptr + index, _bf16_nearest(p), mask=live)
    if STATE == 0:
        tl.store(m_ptr + index, m, mask=live)
        tl.store(v_ptr + index, v, mask=live)
    elif STATE == 1:
        tl.store(m_ptr + index, _bf16_stochastic(m, index, key_m.to(tl.uint32)), mask=live)
        tl.store(v_ptr + index, _bf16_stochastic(v, index, key_v.to(tl.uint32)), mask=live)
    else:
        max_m = tl.max(tl.where(live, tl.abs(m), 0.0), axis=0)
        max_v = tl.max(tl.where(live, v, 0.0), axis=0)
        tl.store(m_scale_ptr + block, max_m)
        tl.store(v_scale_ptr + block, max_v)
        div_m = tl.where(max_m > 0.0, max_m, 1.0)
        div_v = tl.where(max_v > 0.0, max_v, 1.0)
        tl.store(m_ptr + index, _quantize(table_m_ptr, tl.math.div_rn(m, div_m)), mask=live)
        tl.store(v_ptr + index, _quantize(table_v_ptr, tl.math.div_rn(v, div_v)), mask=live)


__all__ = ["adamw_fused", "triton"]
