"""The AdamW of csrc/adamw.c as one fused Triton kernel, for blocks updated on the GPU.

The GPU update share (engine/gpu_share.py) updates a streamed block on the device once its
master and states are there. The torch reference of the C kernels (optim/update_io.py) does it
in 40-250 elementwise kernels per chunk, moving 272-500 bytes per parameter through GPU memory
(planning/share_time.py); this kernel reads p, m, v and the gradient once and writes p, m, v
and the bf16 shadow once (14-28 bytes per parameter), one program per QUANT_BLOCK values.

Bit for bit the C kernel: every operation is the C code's IEEE float32 operation in its order,
with no contraction into fused multiply-adds (`enable_fp_fusion=False`), the correctly rounded
division and square root (`div_rn`, `sqrt_rn`: Triton's `/` and `sqrt` are approximate on
CUDA), round-to-nearest-even for the bf16 shadow, the same lowbias32 bits for bf16 states'
stochastic rounding, and the same integer lookup (store/states.py quantize_table) for int8
codes. tests/optim/test_triton_adamw.py checks it against the C kernel on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, numpy's IEEE float32) and, where CUDA is, compiled.

Covered: an fp32 master with fp32, bf16 or int8 states, an fp32 or bf16 gradient, with or
without a bf16 shadow. A bf16 master and int4 states keep the torch reference (`supports`).
Triton is imported lazily: CPU installs of torch do not have it, and never need this kernel.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from megatrain.optim.update_io import StepScalars
from megatrain.store.blocks import ParamBlock
from megatrain.store.states import QUANT_BLOCK, dynamic_map, quantize_table, rounding_keys

STATE_CODES = {"fp32": 0, "bf16": 1, "int8": 2}
"""The kernel's STATE constant for each state dtype it takes."""


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@cache
def _kernel() -> Any:
    """The compiled kernel, or None where Triton cannot be imported."""
    try:
        from megatrain.optim import triton_adamw_kernel
    except ImportError:
        return None
    return triton_adamw_kernel.adamw_fused


def takes(master_dtype: str, state_dtype: str) -> bool:
    """Whether this machine's fused kernel updates blocks of these formats (Triton installed,
    an fp32 master, states it has a STATE code for): the planner's and the engine's rule."""
    return master_dtype == "fp32" and state_dtype in STATE_CODES and _kernel() is not None


def supports(block: ParamBlock) -> bool:
    """Whether the fused kernel updates `block` where its tensors are now: formats it `takes`,
    on a CUDA device (or the CPU under the interpreter)."""
    return (
        (block.master.is_cuda or interpreting())
        and block.grad_landing.dtype in (torch.float32, torch.bfloat16)
        and takes(block.master_dtype, block.state_dtype)
    )


@cache
def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """int8 states' maps and quantizing lookups on `device`: map m, table m, map v, table v."""
    return tuple(
        t.to(device)
        for signed in (True, False)
        for t in (dynamic_map(signed)[0], quantize_table(signed))
    )


def _int32(key: int) -> int:
    """A uint32 key as the int32 of its bits: every key reaches the kernel as one type (no
    recompiling when a key passes 2^31); the kernel reads it back as uint32."""
    return key - (1 << 32) if key >= 1 << 31 else key


def fused_update(block: ParamBlock, s: StepScalars) -> None:
    """`block`'s AdamW step (`block.step` already counts it) with scalars `s`, in place on the
    device its tensors live on; the same result as the C kernel's update of the host block."""
    kernel = _kernel()
    assert kernel is not None and supports(block)
    state = STATE_CODES[block.state_dtype]
    key_m, key_v = (_int32(k) for k in rounding_keys(block.rounding_name, block.step))
    grad = block.grad_landing
    maps = _tables(block.master.device) if state == 2 else (block.master,) * 4
    scale_m = block.exp_avg_scale if state == 2 else block.master
    scale_v = block.exp_avg_sq_scale if state == 2 else block.master
    shadow = block.shadow
    options = {} if interpreting() else {"enable_fp_fusion": False}
    grid = (-(-block.numel // QUANT_BLOCK),)
    kernel[grid](
        block.master,
        block.exp_avg,
        block.exp_avg_sq,
        scale_m,
        scale_v,
        grad,
        shadow if shadow is not None else block.master,
        *maps,
        block.numel,
        block.decay_numel,
        *s.as_c_floats(),
        key_m,
        key_v,
        STATE=state,
        G_BF16=grad.dtype == torch.bfloat16,
        SHADOW=shadow is not None,
        BLOCK=QUANT_BLOCK,
        **options,
    )
