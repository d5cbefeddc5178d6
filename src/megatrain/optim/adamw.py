"""AdamW on the host, one parameter block at a time, on the fp32 master weights.

Decoupled weight decay (on the block's decayed range only), bias correction, and a gradient
scale (the global-norm clipping coefficient) applied to the gradient as it is read. The new
bf16 shadow is written in the same pass. Two implementations, picked by `impl`:

- "c": csrc/adamw.c, one pass over memory (reads p, m, v, g; writes p, m, v, shadow), OpenMP.
- "torch": `torch._fused_adamw_` (the kernel behind `torch.optim.AdamW(fused=True)`) plus a
  separate cast pass for the shadow, and a conversion pass when the gradient is bf16.
- "auto": "c" when the kernel builds on this machine, else "torch".

Blocks updated on the compute device (the GPU tier, engine/tier.py, and the GPU update share,
engine/gpu_share.py) take `update_device`: the fused Triton kernel, or the torch reference of
the C kernel, both bit for bit the C kernel's result.
Both release the GIL, so a host worker thread can run them while the main thread drives the GPU.
Results equal `torch.optim.AdamW` + `clip_grad_norm_` to fp32 rounding (tests/test_adamw.py).

Blocks whose m and v are compressed (`ParamBlock.state_dtype` "bf16", "int8" or "int4", layouts
and rounding in store/states.py and store/int4.py) take the same update with m and v dequantized
as read and rounded as written: "c" runs csrc/adamw.c's mt_adamw_bf16 / _int8 / _int4 (one pass
over memory), "torch" runs `update_compressed_reference`, plain PyTorch ops in the same order on
the same float32 scalars, which the C kernel equals bit for bit
(tests/optim/test_optim_states_parity.py, test_optim_states_int4.py).
Blocks with a bf16 master (`ParamBlock.master_dtype`) take optim/bf16_master.py's update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatrain.native import load_adamw_kernel
from megatrain.optim import triton_adamw
from megatrain.optim.bf16_master import update_bf16_master_c, update_bf16_master_reference
from megatrain.optim.update_io import (
    StepScalars,
    adamw_chunk,
    read_states,
    scalar_tensors,
    write_states,
)
from megatrain.store.blocks import ParamBlock
from megatrain.store.int4 import (
    int4_kernel_mids,
    int4_map,
)
from megatrain.store.states import (
    QUANT_BLOCK,
    dynamic_map,
    quantize_table,
    rounding_keys,
)

DEVICE_CHUNK = 4096 * QUANT_BLOCK
"""Values per pass of the torch reference (`update_reference`) on a device (8M): each pass is
40-250 kernel launches (fp32 states to bf16 rounding), issued beside the main thread's (the
share's worker thread, under the GIL), so passes are large: a 0.6B-parameter
block is 72 passes, about 6k launches with int8 states; the temporaries (engine/gpu_share.py
WORK_BYTES) grow with it. The fused kernel (optim/triton_adamw.py) takes a block in one launch."""


@dataclass(frozen=True)
class AdamWHyper:
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


class CpuAdamW:
    def __init__(self, hyper: AdamWHyper, *, impl: str = "auto", num_threads: int | None = None):
        if impl not in ("auto", "c", "torch"):
            raise ValueError(f"optimizer.impl must be auto, c or torch, got {impl!r}")
        self.hyper = hyper
        self._lib = load_adamw_kernel() if impl in ("auto", "c") else None
        if impl == "c" and self._lib is None:
            raise ValueError(
                "optimizer.impl: c needs a C compiler with OpenMP (cc/gcc); "
                "install one or use impl: torch"
            )
        self.impl = "c" if self._lib is not None else "torch"
        self.num_threads = num_threads or torch.get_num_threads()

    def update(self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on the host `block` with its landed gradient times `grad_scale`."""
        block.step += 1
        beta1, beta2 = self.hyper.betas
        bc1 = 1.0 - beta1**block.step
        bc2_sqrt = math.sqrt(1.0 - beta2**block.step)
        if block.state_dtype != "fp32" or block.master_dtype != "fp32":
            scalars = self._scalars(block, lr, grad_scale)
            if block.master_dtype != "fp32":
                self._update_bf16_master(block, scalars)
            elif self._lib is not None:
                self._update_compressed_c(block, scalars)
            else:
                update_compressed_reference(block, scalars)
            return
        ranges = [
            (0, block.decay_numel, 1.0 - lr * self.hyper.weight_decay),
            (block.decay_numel, block.numel, 1.0),
        ]
        for start, end, decay in ranges:
            if end > start:
                if self._lib is not None:
                    self._update_c(block, start, end, decay, lr / bc1, bc2_sqrt, grad_scale)
                else:
                    self._update_torch(
                        block,
                        start,
                        end,
                        lr,
                        grad_scale,
                        self.hyper.weight_decay if decay != 1.0 else 0.0,
                    )

    def update_reference(
        self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0, chunk: int
    ) -> None:
        """One AdamW step on `block` through the torch reference of its C kernel, `chunk`
        values a pass, on whatever device its tensors live (engine/gpu_share.py): every
        format, bit for bit the C kernel's result (fp32 states with an fp32 master too:
        `adamw_chunk` is mt_adamw's arithmetic, in its order)."""
        block.step += 1
        scalars = self._scalars(block, lr, grad_scale)
        if block.master_dtype != "fp32":
            update_bf16_master_reference(block, scalars, chunk=chunk)
        else:
            update_compressed_reference(block, scalars, chunk=chunk)

    def update_device(
        self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0, chunk: int
    ) -> None:
        """One AdamW step on `block`, whose master, states and gradient live on the compute
        device (engine/gpu_share.py): the fused Triton kernel where it takes the block's
        formats (optim/triton_adamw.py), else `update_reference`; either is bit for bit the
        C kernel's result."""
        if triton_adamw.supports(block):
            block.step += 1
            triton_adamw.fused_update(block, self._scalars(block, lr, grad_scale))
            return
        self.update_reference(block, lr=lr, grad_scale=grad_scale, chunk=chunk)

    def _scalars(self, block: ParamBlock, lr: float, grad_scale: float) -> StepScalars:
        """The float32 scalars of `block`'s coming update (`block.step` already counts it)."""
        beta1, beta2 = self.hyper.betas
        return StepScalars(
            decay=1.0 - lr * self.hyper.weight_decay,
            beta2=beta2,
            one_minus_b1=1.0 - beta1,
            one_minus_b2=1.0 - beta2,
            step_size=lr / (1.0 - beta1**block.step),
            bc2_sqrt=math.sqrt(1.0 - beta2**block.step),
            eps=self.hyper.eps,
            grad_scale=grad_scale,
        )

    def _update_c(
        self,
        block: ParamBlock,
        start: int,
        end: int,
        decay: float,
        step_size: float,
        bc2_sqrt: float,
        grad_scale: float,
    ) -> None:
        assert self._lib is not None
        beta1, beta2 = self.hyper.betas
        grad = block.grad_landing
        shadow = block.shadow

        def ptr(t: torch.Tensor) -> int:
            return t.data_ptr() + start * t.element_size()

        self._lib.mt_adamw(
            ptr(block.master),
            ptr(block.exp_avg),
            ptr(block.exp_avg_sq),
            ptr(grad),
            int(grad.dtype == torch.bfloat16),
            ptr(shadow) if shadow is not None else None,
            end - start,
            decay,
            beta2,
            1.0 - beta1,
            1.0 - beta2,
            step_size,
            bc2_sqrt,
            self.hyper.eps,
            grad_scale,
            self.num_threads,
        )

    def _update_bf16_master(self, block: ParamBlock, s: StepScalars) -> None:
        if self._lib is not None:
            update_bf16_master_c(self._lib, block, s, self.num_threads)
        else:
            update_bf16_master_reference(block, s)

    def _update_compressed_c(self, block: ParamBlock, s: StepScalars) -> None:
        assert self._lib is not None
        grad, shadow = block.grad_landing, block.shadow
        common = (
            grad.data_ptr(),
            int(grad.dtype == torch.bfloat16),
            shadow.data_ptr() if shadow is not None else None,
            block.numel,
            block.decay_numel,
            *s.as_c_floats(),
        )
        if block.state_dtype == "bf16":
            key_m, key_v = rounding_keys(block.rounding_name, block.step)
            self._lib.mt_adamw_bf16(
                block.master.data_ptr(),
                block.exp_avg.data_ptr(),
                block.exp_avg_sq.data_ptr(),
                *common,
                key_m,
                key_v,
                self.num_threads,
            )
            return
        assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
        if block.state_dtype == "int4":
            self._update_int4_c(block, common)
            return
        tables = [(dynamic_map(signed)[0], quantize_table(signed)) for signed in (True, False)]
        self._lib.mt_adamw_int8(
            block.master.data_ptr(),
            block.exp_avg.data_ptr(),
            block.exp_avg_scale.data_ptr(),
            block.exp_avg_sq.data_ptr(),
            block.exp_avg_sq_scale.data_ptr(),
            *common,
            *(t.data_ptr() for table in tables for t in table),  # map, lookup of m, of v
            self.num_threads,
        )

    def _update_int4_c(self, block: ParamBlock, common: tuple[object, ...]) -> None:
        assert self._lib is not None
        assert block.exp_avg_scale is not None and block.exp_avg_sq_scale is not None
        self._lib.mt_adamw_int4(
            block.master.data_ptr(),
            block.exp_avg.data_ptr(),
            block.exp_avg_scale.data_ptr(),
            block.exp_avg_sq.data_ptr(),
            block.exp_avg_sq_scale.data_ptr(),
            *common,
            int4_map(True)[0].data_ptr(),  # m's values; v's are computed (csrc/adamw.c)
            int4_kernel_mids().data_ptr(),
            self.num_threads,
        )

    def _update_torch(
        self,
        block: ParamBlock,
        start: int,
        end: int,
        lr: float,
        grad_scale: float,
        weight_decay: float,
    ) -> None:
        beta1, beta2 = self.hyper.betas
        grad = block.grad_landing[start:end].float()  # a copy when the gradient is bf16
        if grad_scale != 1.0:
            grad.mul_(grad_scale)  # the landed gradient is not needed after its update
        p = block.master[start:end]
        torch._fused_adamw_(
            [p],
            [grad],
            [block.exp_avg[start:end]],
            [block.exp_avg_sq[start:end]],
            [],
            [torch.full((), float(block.step), device=p.device)],  # a fill, not a copy
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=self.hyper.eps,
            amsgrad=False,
            maximize=False,
        )
        if block.shadow is not None:
            block.shadow[start:end].copy_(p)


def update_compressed_reference(
    block: ParamBlock, s: StepScalars, *, chunk: int = 64 * QUANT_BLOCK
) -> None:
    """The compressed-state update in plain PyTorch, `chunk` elements at a time.

    Each operation is one correctly rounded float32 op in the C kernel's order, so results are
    bit for bit the kernel's; device-agnostic (the block's tensors may live on any device).
    """
    assert chunk % QUANT_BLOCK == 0
    f32 = scalar_tensors(s, block.master.device)
    keys = rounding_keys(block.rounding_name, block.step)
    for lo in range(0, block.numel, chunk):
        hi = min(lo + chunk, block.numel)
        grad = block.grad_landing[lo:hi].float() * f32["grad_scale"]  # read before the shadow
        m_old, v_old = read_states(block, lo, hi)
        p = block.master[lo:hi]
        decayed = max(0, min(block.decay_numel, hi) - lo)
        m, v = adamw_chunk(p, m_old, v_old, grad, f32, decayed)
        if block.shadow is not None:
            block.shadow[lo:hi].copy_(p)
        write_states(block, lo, hi, m, v, keys)
