"""Master-weight layouts of the host store: fp32, or bf16 with stochastic rounding.

`optimizer.master_dtype` picks one per store; a block's is its master's dtype
(`ParamBlock.master_dtype`). Host bytes per parameter of a block's weights, its streamed copy
and its gradient landing (besides m and v, store/states.py), with bf16 compute:

- fp32: 4 (master, pageable) + 2 (bf16 shadow, pinned: the copy the device streams; between a
  layer's backward and its update it holds the bf16 gradient, so gradients cost nothing) = 6.
- bf16: 2 (the master, pinned: it IS the streamed copy) + 2 (a pinned bf16 gradient landing:
  the streamed copy cannot take the gradient any more, it holds the weights) = 4.

fp32 compute keeps fp32 (master and gradient pinned, 8); a bf16 master needs bf16 compute.

The bf16 master's update runs in fp32 (the AdamW arithmetic of every other path) and the
result is rounded to bf16 stochastically: a step of 1e-5 of a weight is 1/800 to 1/400 of a
bf16 ulp, so round-to-nearest would return the old weight every time and training would stall
(Zamirai et al. 2020, arXiv 2010.06192; Ozkara et al. 2025, arXiv 2502.20566). Stochastic
rounding is unbiased, E[stored] = exact, so many small steps add up as in fp32, with noise of
at most one ulp per step. The bits are store/states.py's: the hash of (block, step, "p",
element index) that bf16 m and v use (`rounding_key`), so runs repeat exactly, resume bit for
bit, and do not depend on the thread count. The load rounds the model's weights to nearest
once.
"""

from __future__ import annotations

import torch

from megatrain.choices import MASTER_DTYPES
from megatrain.store.blocks import to_bf16_
from megatrain.store.grads import hold_buffers
from megatrain.store.memory import host_zeros

MASTER_KEY = "p"
"""The tensor name salting a bf16 master's rounding key (store/states.py rounding_key)."""


def check_master_dtype(master_dtype: str) -> None:
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(
            f"optimizer.master_dtype must be one of {', '.join(MASTER_DTYPES)}, "
            f"got {master_dtype!r}"
        )


def master_bytes_per_param(master_dtype: str) -> int:
    """Bytes of the master itself (what a checkpoint stores of the weights)."""
    check_master_dtype(master_dtype)
    return 4 if master_dtype == "fp32" else 2


def weight_buffers(
    numel: int, master_dtype: str, *, bf16_compute: bool, grad_hold: str | None = None
) -> tuple[int, list[int]]:
    """(pageable bytes, pinned buffers' bytes) of a block's master, streamed copy and own
    gradient landing on the host (see the module docstring; `grad_hold`: store/grads.py, by
    default a bf16 master's bf16 landing); what HostStore allocates. A pool of shared landings
    is the store's, not the block's (store/grads.py pool_buffers)."""
    check_master_dtype(master_dtype)
    if not bf16_compute:  # the fp32 master is the streamed copy, an fp32 gradient lands
        assert master_dtype == "fp32", "a bf16 master needs bf16 compute"
        return 0, [4 * numel, *hold_buffers(numel, "fp32")]
    if master_dtype == "fp32":  # master pageable, the bf16 shadow pinned (the landing too)
        return 4 * numel, [2 * numel]
    return 0, [2 * numel, *hold_buffers(numel, grad_hold or "bf16")]  # the bf16 master


def weight_bytes_per_param(
    master_dtype: str, *, bf16_compute: bool = True, grad_hold: str | None = None
) -> float:
    """Bytes per parameter of weights and gradient landing, amortised over a large block."""
    n = 1 << 20
    pageable, pinned = weight_buffers(
        n, master_dtype, bf16_compute=bf16_compute, grad_hold=grad_hold
    )
    return (pageable + sum(pinned)) / n


def bf16_master_of(master: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """A new bf16 master (host, pinned if `pin`) of an fp32 one, rounded to nearest."""
    out = host_zeros(master.numel(), torch.bfloat16, pin=pin)
    to_bf16_(out, master)
    return out
