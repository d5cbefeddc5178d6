"""Host blocks and gradients for the AdamW kernel tests (tests/optim, tests/engine): a block
of any state dtype with a seeded master, and gradients whose magnitudes spread over decades."""

from __future__ import annotations

import torch

from megatrain.store.blocks import ParamBlock
from megatrain.store.states import allocate_states


def host_block(
    n: int,
    decay_numel: int,
    state_dtype: str,
    bf16_grads: bool,
    *,
    seed: int = 0,
    name: str = "layer.7",
) -> ParamBlock:
    """A block of `n` values (the first `decay_numel` decayed), a master of N(0, 0.02) from
    `seed`, zero states in `state_dtype`; its gradient lands in a bf16 shadow (`bf16_grads`)
    or an fp32 buffer, both uninitialised. `name` keys bf16 states' stochastic rounding."""
    gen = torch.Generator().manual_seed(seed)
    block = ParamBlock(
        name=name,
        entries=[],
        numel=n,
        decay_numel=decay_numel,
        master=torch.randn(n, generator=gen) * 0.02,
        state_dtype=state_dtype,
        **allocate_states(n, state_dtype),  # type: ignore[arg-type]
    )
    if bf16_grads:
        block.shadow = torch.empty(n, dtype=torch.bfloat16)
    else:
        block.grad = torch.empty(n)
    return block


def spread_grad(n: int, step: int, gen: torch.Generator) -> torch.Tensor:
    """A gradient whose magnitudes spread over decades within a block, every other step
    100x smaller."""
    spread = 10.0 ** torch.randint(-4, 1, (n,), generator=gen).float()
    return torch.randn(n, generator=gen) * spread * 10.0 ** -(2 * (step % 2))
