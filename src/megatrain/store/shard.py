"""ZeRO-3 sharding of the host store: rank r of `world` keeps 1/world of every block.

A block's flat layout (store/blocks.py) is padded with zeros to a multiple of `world`; rank r
owns the contiguous range [r * n, (r + 1) * n) of it, n = padded / world, and keeps only that
range of the fp32 master, the AdamW states and the bf16 shadow (or fp32 gradient landing).
The padding stays zero forever: its gradient is zero (the device accumulator is zeroed over
the padded length), and AdamW maps a zero weight with zero gradient and zero states to zero.

A `ShardedBlock` is a `ParamBlock` whose flat tensors are the shard: `numel` and
`decay_numel` describe the shard (what the optimizer and checkpoints see), while its `entries`
keep the offsets of the full layout (what the device binds its views to, after the all-gather).
`layout_numel(block)` is the length of that full (padded) layout for any block, so a world of
one is the same code path with one shard that is the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.memory import host_zeros


@dataclass
class ShardedBlock(ParamBlock):
    padded_numel: int = 0  # length of the full layout padded to a multiple of the world size
    shard_offset: int = 0  # where this rank's shard starts in that layout
    full_numel: int = 0  # the block's parameters (padded_numel minus the padding)

    @property
    def rank(self) -> int:
        return self.shard_offset // self.numel

    @property
    def world_size(self) -> int:
        return self.padded_numel // self.numel


def layout_numel(block: ParamBlock) -> int:
    """Length of the block's full flat layout on the device (padded when sharded)."""
    return block.padded_numel if isinstance(block, ShardedBlock) else block.numel


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int, int]:
    """(padded length, shard start, shard length) of a block of `numel` for `rank`."""
    n = -(-numel // world)
    return n * world, rank * n, n


def shard_block(block: ParamBlock, rank: int, world: int, *, pin_memory: bool) -> ShardedBlock:
    """Rank `rank`'s shard of `block` (new host tensors; `block` can be freed afterwards)."""
    padded, start, n = shard_range(block.numel, rank, world)
    lo, hi = min(start, block.numel), min(start + n, block.numel)
    pin_master = pin_memory and block.shadow is None  # fp32 compute: the master is the source

    def take(src: torch.Tensor, pin: bool = False) -> torch.Tensor:
        out = host_zeros(n, src.dtype, pin=pin)
        out[: hi - lo].copy_(src[lo:hi])
        return out

    sharded = ShardedBlock(
        name=block.name,
        entries=block.entries,
        numel=n,
        decay_numel=min(max(block.decay_numel - start, 0), n),
        master=take(block.master, pin_master),
        exp_avg=take(block.exp_avg),
        exp_avg_sq=take(block.exp_avg_sq),
        step=block.step,
        padded_numel=padded,
        shard_offset=start,
        full_numel=block.numel,
    )
    if block.shadow is not None:
        sharded.shadow = host_zeros(n, torch.bfloat16, pin=pin_memory)
        sharded.refresh_shadow()
    else:
        sharded.grad = host_zeros(n, torch.float32, pin=pin_memory)
    return sharded


def shard_store(store: HostStore, rank: int, world: int) -> None:
    """Replace every block of `store` by rank `rank`'s shard, in place (world > 1 only)."""
    assert world > 1 and 0 <= rank < world, (rank, world)
    pin = store.pin_memory
    store.embed = shard_block(store.embed, rank, world, pin_memory=pin)
    store.layers = [shard_block(b, rank, world, pin_memory=pin) for b in store.layers]
    store.head = shard_block(store.head, rank, world, pin_memory=pin)


def is_sharded(store: HostStore) -> bool:
    return isinstance(store.embed, ShardedBlock)
