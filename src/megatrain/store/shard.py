"""ZeRO-3 sharding of the host store: rank r of `world` keeps 1/world of every block.

A block's flat layout (store/blocks.py) is padded with zeros to a multiple of `world` x
QUANT_BLOCK; rank r owns the contiguous range [r * n, (r + 1) * n) of it, n = padded / world,
and keeps only that range of the fp32 master, the AdamW states (in the store's `state_dtype`)
and the bf16 shadow (or fp32 gradient landing). The padding stays zero forever: its gradient is
zero (the device accumulator is zeroed over the padded length), and AdamW maps a zero weight
with zero gradient and zero states to zero.

Shards are whole int8 quantization blocks (n is a multiple of QUANT_BLOCK, store/states.py), so
rank r's quantization blocks are exactly the whole block's blocks r x n / QUANT_BLOCK, ...: the
sharded int8 update equals the one-process update, and a sharded checkpoint's parts concatenate
into the whole block's codes and scales. The same holds for int4's blocks of 128 (store/int4.py),
which divide QUANT_BLOCK. bf16 stochastic rounding salts its keys with the shard
offset (`ShardedBlock.rounding_name`), so ranks do not reuse each other's random bits.

A `ShardedBlock` is a `ParamBlock` whose flat tensors are the shard: `numel` and
`decay_numel` describe the shard (what the optimizer and checkpoints see), while its `entries`
keep the offsets of the full layout (what the device binds its views to, after the all-gather).
`layout_numel(block)` is the length of that full (padded) layout for any block, so a world of
one is the same code path with one shard that is the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.store.blocks import ParamBlock, ParamEntry
from megatrain.store.grads import allocate_hold
from megatrain.store.host import HostStore
from megatrain.store.master import bf16_master_of
from megatrain.store.memory import host_zeros
from megatrain.store.states import QUANT_BLOCK


@dataclass
class ShardedBlock(ParamBlock):
    padded_numel: int = 0  # length of the full layout padded to a multiple of world x QUANT_BLOCK
    shard_offset: int = 0  # where this rank's shard starts in that layout
    full_numel: int = 0  # the block's parameters (padded_numel minus the padding)

    @property
    def rank(self) -> int:
        return self.shard_offset // self.numel

    @property
    def world_size(self) -> int:
        return self.padded_numel // self.numel

    @property
    def rounding_name(self) -> str:
        return self.name if self.shard_offset == 0 else f"{self.name}@{self.shard_offset}"


def layout_numel(block: ParamBlock) -> int:
    """Length of the block's full flat layout on the device (padded when sharded)."""
    return block.padded_numel if isinstance(block, ShardedBlock) else block.numel


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int, int]:
    """(padded length, shard start, shard length) of a block of `numel` for `rank`."""
    n = -(-numel // (world * QUANT_BLOCK)) * QUANT_BLOCK
    return n * world, rank * n, n


def padded_numel(numel: int, world: int) -> int:
    """A block of `numel` as the ranks of `world` hold it, padded (`shard_range`); itself for
    one process."""
    return shard_range(numel, 0, world)[0] if world > 1 else numel


def shard_master(
    master: torch.Tensor,
    *,
    name: str,
    entries: list[ParamEntry],
    decay_numel: int,
    state_dtype: str,
    bf16: bool,
    rank: int,
    world: int,
    pin_memory: bool,
    master_dtype: str = "fp32",
    grad_hold: str = "bf16",
) -> ShardedBlock:
    """Rank `rank`'s shard of a fresh block given by its whole fp32 `master`: the shard's
    master, zero AdamW states and its bf16 shadow (`bf16` compute) or fp32 gradient landing, in
    new host tensors, so `master` can be freed afterwards. The whole block's states and shadow
    are never made (HostStore under ranks builds only its master). A bf16 `master_dtype`: the
    shard's master is bf16 (the streamed copy) with a gradient landing per `grad_hold`
    (store/grads.py: the shard's own bf16 or int8 landing, or none when a pool serves it)."""
    numel = master.numel()
    padded, start, n = shard_range(numel, rank, world)
    lo, hi = min(start, numel), min(start + n, numel)
    part = host_zeros(n, torch.float32, pin=pin_memory and not bf16)
    part[: hi - lo].copy_(master[lo:hi])  # fp32 compute: the master is the source
    if master_dtype == "bf16":
        part = bf16_master_of(part, pin=pin_memory)
    sharded = ShardedBlock.with_states(
        name=name,
        entries=entries,
        numel=n,
        decay_numel=min(max(decay_numel - start, 0), n),
        master=part,
        state_dtype=state_dtype,
        padded_numel=padded,
        shard_offset=start,
        full_numel=numel,
    )
    if master_dtype == "bf16":
        for key, tensor in allocate_hold(n, grad_hold, pin=pin_memory).items():
            setattr(sharded, key, tensor)
    elif bf16:
        sharded.shadow = host_zeros(n, torch.bfloat16, pin=pin_memory)
        sharded.refresh_shadow()
    else:
        sharded.grad = host_zeros(n, torch.float32, pin=pin_memory)
    return sharded


def shard_block(block: ParamBlock, rank: int, world: int, *, pin_memory: bool) -> ShardedBlock:
    """Rank `rank`'s shard of a fresh whole `block` (shard_master of its master)."""
    assert block.step == 0, "shard a store before its first update"
    return shard_master(
        block.master,
        name=block.name,
        entries=block.entries,
        decay_numel=block.decay_numel,
        state_dtype=block.state_dtype,
        master_dtype=block.master_dtype,
        bf16=block.shadow is not None or block.master_dtype == "bf16",
        rank=rank,
        world=world,
        pin_memory=pin_memory,
    )


def is_sharded(store: HostStore) -> bool:
    return isinstance(store.embed, ShardedBlock)
