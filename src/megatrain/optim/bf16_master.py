"""AdamW on a block with bf16 master weights (`optimizer.master_dtype: bf16`, store/master.py).

The update is the fp32 AdamW arithmetic of the other paths (optim/adamw.py), with the master
read from bf16 and the new weight rounded stochastically back into it (bits: the hash of
(block, step, "p", index), store/states.py `rounding_key`); m and v are read and written in the
block's `state_dtype` as on an fp32 master. Two implementations, bit for bit the same:

- `update_bf16_master_c`: csrc/adamw.c mt_adamw_bf16m_{fp32,bf16,int8}, one pass, OpenMP.
- `update_bf16_master_reference`: plain PyTorch ops in the kernel's order on the same float32
  scalars, any device (tests, and `impl: torch`).

A bf16 master is the block's streamed copy: there is no shadow to write; the gradient comes
from the block's own landing (`ParamBlock.grad`): bf16, or int8 codes times their block's unit
(`grad_unit`, store/grads.py), read as one fp32 product in both implementations.
"""

from __future__ import annotations

import ctypes

import torch

from megatrain.optim.update_io import (
    StepScalars,
    adamw_chunk,
    read_states,
    scalar_tensors,
    write_states,
)
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import held_gradient
from megatrain.store.int4 import int4_kernel_mids, int4_map
from megatrain.store.master import MASTER_KEY
from megatrain.store.states import (
    QUANT_BLOCK,
    bf16_stochastic,
    dynamic_map,
    quantize_table,
    rounding_key,
    rounding_keys,
)


def update_bf16_master_c(
    lib: ctypes.CDLL, block: ParamBlock, s: StepScalars, num_threads: int
) -> None:
    assert block.master_dtype == "bf16" and block.shadow is None
    grad = block.grad_landing
    key_p = rounding_key(block.rounding_name, block.step, MASTER_KEY)
    common = (
        grad.data_ptr(),
        grad_kind(grad),
        block.grad_unit.data_ptr() if block.grad_unit is not None else None,
        block.numel,
        block.decay_numel,
        *s.as_c_floats(),
    )
    p, m, v = (t.data_ptr() for t in (block.master, block.exp_avg, block.exp_avg_sq))
    if block.state_dtype == "fp32":
        lib.mt_adamw_bf16m_fp32(p, m, v, *common, key_p, num_threads)
    elif block.state_dtype == "bf16":
        keys = rounding_keys(block.rounding_name, block.step)
        lib.mt_adamw_bf16m_bf16(p, m, v, *common, key_p, *keys, num_threads)
    elif block.state_dtype == "int4":
        assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
        lib.mt_adamw_bf16m_int4(
            p,
            m,
            block.exp_avg_scale.data_ptr(),
            v,
            block.exp_avg_sq_scale.data_ptr(),
            *common,
            int4_map(True)[0].data_ptr(),  # m's values; v's are computed (csrc/adamw.c)
            int4_kernel_mids().data_ptr(),
            key_p,
            num_threads,
        )
    else:
        assert block.state_dtype == "int8"
        assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
        tables = [(dynamic_map(signed)[0], quantize_table(signed)) for signed in (True, False)]
        lib.mt_adamw_bf16m_int8(
            p,
            m,
            block.exp_avg_scale.data_ptr(),
            v,
            block.exp_avg_sq_scale.data_ptr(),
            *common,
            *(t.data_ptr() for table in tables for t in table),  # map, lookup of m, of v
            key_p,
            num_threads,
        )


def update_bf16_master_reference(
    block: ParamBlock, s: StepScalars, *, chunk: int = 64 * QUANT_BLOCK
) -> None:
    """The bf16-master update in plain PyTorch, `chunk` elements at a time: each operation one
    correctly rounded float32 op in the C kernel's order, so results equal it bit for bit."""
    assert chunk % QUANT_BLOCK == 0 and block.master_dtype == "bf16"
    f32 = scalar_tensors(s, block.master.device)
    key_p = rounding_key(block.rounding_name, block.step, MASTER_KEY)
    keys = rounding_keys(block.rounding_name, block.step)
    for lo in range(0, block.numel, chunk):
        hi = min(lo + chunk, block.numel)
        grad = held_gradient(block, lo, hi) * f32["grad_scale"]
        m_old, v_old = read_states(block, lo, hi)
        p = block.master[lo:hi].float()  # a copy: the master is written once, rounded
        decayed = max(0, min(block.decay_numel, hi) - lo)
        m, v = adamw_chunk(p, m_old, v_old, grad, f32, decayed)
        block.master[lo:hi].copy_(bf16_stochastic(p, key_p, lo))
        write_states(block, lo, hi, m, v, keys)


_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # csrc/adamw.c g_kind


def grad_kind(grad: torch.Tensor) -> int:
    """csrc/adamw.c's code for how a bf16 master's gradient is stored."""
    return _GRAD_KINDS[grad.dtype]
