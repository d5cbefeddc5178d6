"""AdamW on the host, one parameter block at a time, on the fp32 master weights.

Decoupled weight decay (on the block's decayed range only), bias correction, and a gradient
scale (the global-norm clipping coefficient) applied to the gradient as it is read. The new
bf16 shadow is written in the same pass. Two implementations, picked by `impl`:

- "c": csrc/adamw.c, one pass over memory (reads p, m, v, g; writes p, m, v, shadow), OpenMP.
- "torch": `torch._fused_adamw_` (the kernel behind `torch.optim.AdamW(fused=True)`) plus a
  separate cast pass for the shadow, and a conversion pass when the gradient is bf16.
- "auto": "c" when the kernel builds on this machine, else "torch".

Blocks of the GPU tier take the "torch" path on the device (`update(on_device=True)`).
Both release the GIL, so a host worker thread can run them while the main thread drives the GPU.
Results equal `torch.optim.AdamW` + `clip_grad_norm_` to fp32 rounding (tests/test_adamw.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatrain.native import load_adamw_kernel
from megatrain.store.blocks import ParamBlock


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

    def update(
        self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0, on_device: bool = False
    ) -> None:
        """One AdamW step on `block` with its landed gradient times `grad_scale`.

        `on_device`: the block lives on the compute device (GPU tier, engine/tier.py): the
        "torch" implementation runs there, queued on the current stream (no host sync).
        """
        block.step += 1
        beta1, beta2 = self.hyper.betas
        bc1 = 1.0 - beta1**block.step
        bc2_sqrt = math.sqrt(1.0 - beta2**block.step)
        ranges = [
            (0, block.decay_numel, 1.0 - lr * self.hyper.weight_decay),
            (block.decay_numel, block.numel, 1.0),
        ]
        for start, end, decay in ranges:
            if end > start:
                if self._lib is not None and not on_device:
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
