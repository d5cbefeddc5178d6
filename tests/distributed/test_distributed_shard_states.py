"""AdamW on a rank's shard equals AdamW on the whole block, per state dtype (store/shard.py).

The optimizer is elementwise except for int8's and int4's per-quantization-block absmax, and
shards are whole quantization blocks, so updating each shard with its slice of the gradient must
give, reassembled, bit for bit the whole block's master and states (fp32, int8, int4), over
several steps. (int4's last partial block: the whole block's unused nibbles hold the codes of 0,
and so do the shard's padding values, whose m stays 0 and whose v, at most 1/16 of the block's
largest, keeps the lowest code.)
bf16 stochastic rounding salts its keys with the shard offset, so shard 0 (offset 0) equals
the whole block bit for bit, and the other shards' rounding differs from the whole block's
only by its random bits: one step's master (computed before the states are rounded) is equal.
"""

from __future__ import annotations

import pytest
import torch

from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.shard import ShardedBlock, shard_block
from megatrain.store.states import QUANT_BLOCK
from state_blocks import host_block

N, DECAY, WORLD, STEPS = 5 * QUANT_BLOCK + 123, 3 * QUANT_BLOCK + 7, 3, 3


def _whole(state_dtype: str) -> ParamBlock:
    block = host_block(N, DECAY, state_dtype, bf16_grads=False, name="layer.2")
    assert block.grad is not None
    block.grad.zero_()
    return block


def _steps(whole: ParamBlock, shards: list[ShardedBlock], impl: str, steps: int) -> None:
    opt = CpuAdamW(AdamWHyper(weight_decay=0.1), impl=impl, num_threads=2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grad = torch.randn(N, generator=gen) * 10.0 ** torch.randint(-4, 1, (N,), generator=gen)
        assert whole.grad is not None
        whole.grad.copy_(grad)
        opt.update(whole, lr=1e-3, grad_scale=0.7)
        padded = torch.cat([grad, torch.zeros(shards[0].padded_numel - N)])
        for s in shards:
            assert s.grad is not None
            s.grad.copy_(padded[s.shard_offset : s.shard_offset + s.numel])
            opt.update(s, lr=1e-3, grad_scale=0.7)


def _cat(shards: list[ShardedBlock], key: str) -> torch.Tensor:
    return torch.cat([getattr(s, key) for s in shards])


@pytest.mark.parametrize("impl", ["c", "torch"])
@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "int4"])
def test_sharded_update_equals_the_whole_block(impl: str, state_dtype: str) -> None:
    if impl == "c" and CpuAdamW(AdamWHyper(), impl="auto").impl != "c":
        pytest.skip("no C compiler")
    whole = _whole(state_dtype)
    shards = [shard_block(whole, r, WORLD, pin_memory=False) for r in range(WORLD)]
    _steps(whole, shards, impl, STEPS)
    assert not _cat(shards, "master")[N:].any()  # the padding stays zero
    for key, t in {"master": whole.master, **whole.state_tensors()}.items():
        full = _cat(shards, key)[: t.numel()]
        if impl == "torch" and state_dtype == "fp32":
            # torch's fused kernel rounds its vector body and its scalar tail differently
            # (FMA contraction), and a shard moves that boundary: <= 2 roundings per op and
            # ~4 ops per element per step.
            torch.testing.assert_close(full, t, rtol=STEPS * 8 * 2.0**-24, atol=1e-3 * 2.0**-20)
        else:
            assert torch.equal(full, t), key


@pytest.mark.parametrize("impl", ["c", "torch"])
def test_sharded_bf16_states(impl: str) -> None:
    if impl == "c" and CpuAdamW(AdamWHyper(), impl="auto").impl != "c":
        pytest.skip("no C compiler")
    whole = _whole("bf16")
    shards = [shard_block(whole, r, WORLD, pin_memory=False) for r in range(WORLD)]
    _steps(whole, shards, impl, 1)
    assert torch.equal(_cat(shards, "master")[:N], whole.master)
    n = shards[0].numel
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(shards[0], key), getattr(whole, key)[:n])
        # rank 1's bits are its own: some element rounds the other way than the whole block's
        assert not torch.equal(getattr(shards[1], key), getattr(whole, key)[n : 2 * n])
