"""What the compressed-state updates share: one block's update scalars (float32, as the C
kernels take them) and the chunked reads and writes of bf16 / int8 m and v in their stored
layouts (store/states.py), used by the torch references of optim/adamw.py and
optim/bf16_master.py so that both round exactly as the C kernels do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.store.blocks import ParamBlock
from megatrain.store.int4 import INT4_BLOCK, INT4_HALF, dequantize_int4, quantize_int4
from megatrain.store.states import (
    QUANT_BLOCK,
    bf16_stochastic,
    dequantize_blockwise,
    quantize_blockwise,
)


@dataclass(frozen=True)
class StepScalars:
    """The scalars of one block's update, as both compressed-state paths use them (float32)."""

    decay: float  # 1 - lr * weight_decay, on the block's decayed range
    beta2: float
    one_minus_b1: float
    one_minus_b2: float
    step_size: float  # lr / (1 - beta1^step)
    bc2_sqrt: float  # sqrt(1 - beta2^step)
    eps: float
    grad_scale: float

    def as_c_floats(self) -> tuple[float, ...]:
        return (
            self.decay,
            self.beta2,
            self.one_minus_b1,
            self.one_minus_b2,
            self.step_size,
            self.bc2_sqrt,
            self.eps,
            self.grad_scale,
        )


def scalar_tensors(s: StepScalars, device: torch.device) -> dict[str, torch.Tensor]:
    """The step's scalars as float32 0-dim tensors on `device` (the references' operands)."""
    return {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in vars(s).items()}


def adamw_chunk(
    p: torch.Tensor,
    m_old: torch.Tensor,
    v_old: torch.Tensor,
    grad: torch.Tensor,
    f32: dict[str, torch.Tensor],
    decayed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of the C kernels' AdamW in plain PyTorch, each operation one correctly rounded
    float32 op in their order: decays the first `decayed` values of `p` and updates `p` in
    place; returns the new m and v."""
    p[:decayed].mul_(f32["decay"])
    m = m_old + f32["one_minus_b1"] * (grad - m_old)
    v = v_old * f32["beta2"] + f32["one_minus_b2"] * grad * grad
    # sqrt in float64, rounded once to float32: the correctly rounded sqrt of C's sqrtf
    # (torch's vectorized float32 sqrt is not, on AVX-512). A full-size divisor: CUDA
    # divides by a 0-dim tensor as a multiply by its reciprocal.
    root = torch.sqrt(v.double()).float()
    denom = root / f32["bc2_sqrt"].expand_as(v) + f32["eps"]
    p.sub_(f32["step_size"] * (m / denom))
    return m, v


def read_states(block: ParamBlock, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    if block.state_dtype == "fp32":
        return block.exp_avg[lo:hi], block.exp_avg_sq[lo:hi]
    if block.state_dtype == "bf16":
        return block.exp_avg[lo:hi].float(), block.exp_avg_sq[lo:hi].float()
    if block.state_dtype == "int4":
        return _read_int4(block, lo, hi)
    assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
    blocks = slice(lo // QUANT_BLOCK, -(-hi // QUANT_BLOCK))
    return (
        dequantize_blockwise(block.exp_avg[lo:hi], block.exp_avg_scale[blocks], signed=True),
        dequantize_blockwise(block.exp_avg_sq[lo:hi], block.exp_avg_sq_scale[blocks], signed=False),
    )


def write_states(
    block: ParamBlock, lo: int, hi: int, m: torch.Tensor, v: torch.Tensor, keys: tuple[int, int]
) -> None:
    if block.state_dtype == "fp32":
        block.exp_avg[lo:hi].copy_(m)
        block.exp_avg_sq[lo:hi].copy_(v)
        return
    if block.state_dtype == "bf16":
        block.exp_avg[lo:hi].copy_(bf16_stochastic(m, keys[0], lo))
        block.exp_avg_sq[lo:hi].copy_(bf16_stochastic(v, keys[1], lo))
        return
    if block.state_dtype == "int4":
        _write_int4(block, lo, m, v)
        return
    assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
    blocks = slice(lo // QUANT_BLOCK, -(-hi // QUANT_BLOCK))
    for codes, scale, value, signed in (
        (block.exp_avg, block.exp_avg_scale, m, True),
        (block.exp_avg_sq, block.exp_avg_sq_scale, v, False),
    ):
        new_codes, absmax = quantize_blockwise(value, signed=signed)
        codes[lo:hi].copy_(new_codes)
        scale[blocks].copy_(absmax)


def _int4_parts(lo: int, n: int) -> tuple[slice, slice]:
    """(bytes of codes, scales) of values lo .. lo + n of an int4 block; lo a block start."""
    assert lo % INT4_BLOCK == 0
    first, end = lo // INT4_BLOCK, -(-(lo + n) // INT4_BLOCK)
    return slice(first * INT4_HALF, end * INT4_HALF), slice(first, end)


def _read_int4(block: ParamBlock, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
    codes, scales = _int4_parts(lo, hi - lo)
    return (
        dequantize_int4(block.exp_avg[codes], block.exp_avg_scale[scales], hi - lo, signed=True),
        dequantize_int4(
            block.exp_avg_sq[codes], block.exp_avg_sq_scale[scales], hi - lo, signed=False
        ),
    )


def _write_int4(block: ParamBlock, lo: int, m: torch.Tensor, v: torch.Tensor) -> None:
    assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
    codes, scales = _int4_parts(lo, m.numel())
    for packed, scale, value, signed in (
        (block.exp_avg, block.exp_avg_scale, m, True),
        (block.exp_avg_sq, block.exp_avg_sq_scale, v, False),
    ):
        new_codes, absmax = quantize_int4(value, signed=signed)
        packed[codes].copy_(new_codes)
        scale[scales].copy_(absmax)
