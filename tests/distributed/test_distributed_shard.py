"""The ZeRO-3 split of a store's blocks (store/shard.py), with a world that does not divide
the blocks (3), in every state dtype, and the per-rank data split (data/ranks.py): exact, no
process group needed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from megatrain.batch import Batch
from megatrain.data.loader import BatchLoader
from megatrain.data.ranks import RankLoader
from megatrain.data.sample import Sample
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.store.host import HostStore
from megatrain.store.shard import ShardedBlock, layout_numel, shard_block, shard_master
from megatrain.store.states import QUANT_BLOCK, num_quant_blocks, zero_code


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
def test_shards_cover_each_block_once_with_zero_padding(state_dtype: str) -> None:
    model = load_causal_lm(None, model_type="llama", tiny=True, seed=0)
    store = HostStore(discover(model), compute_dtype=torch.bfloat16, state_dtype=state_dtype)
    world = 3
    for block in store.blocks:
        shards = [shard_block(block, r, world, pin_memory=False) for r in range(world)]
        padded = layout_numel(shards[0])
        align = world * QUANT_BLOCK  # shards are whole int8 quantization blocks
        assert padded % align == 0 and block.numel <= padded < block.numel + align
        for s in shards:
            codes_per_value = 0.5 if state_dtype == "int4" else 1  # int4: two codes a byte
            assert s.state_dtype == state_dtype and s.exp_avg.numel() == s.numel * codes_per_value
            if state_dtype == "int4":  # whole blocks of 128 (they divide QUANT_BLOCK)
                assert s.exp_avg_scale is not None and s.exp_avg_scale.numel() == s.numel // 128
            if state_dtype == "int8":
                assert s.exp_avg_scale is not None
                assert (
                    s.exp_avg_scale.numel() == num_quant_blocks(s.numel) == s.numel // QUANT_BLOCK
                )
                assert bool((s.exp_avg == zero_code(signed=True)).all())
        whole = torch.cat([s.master for s in shards])
        assert torch.equal(whole[: block.numel], block.master)
        assert not whole[block.numel :].any()  # the padding is zero
        assert torch.equal(torch.cat([s.shadow for s in shards])[: block.numel], block.shadow)
        assert sum(s.decay_numel for s in shards) == block.decay_numel
        assert [s.shard_offset for s in shards] == [r * padded // world for r in range(world)]
        assert all(s.rank == r and s.world_size == world for r, s in enumerate(shards))


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_a_sharded_store_builds_only_whole_masters(compute: torch.dtype) -> None:
    # HostStore under ranks hands each block's whole fp32 master to shard_master and keeps what
    # it returns: the same parts as sharding whole blocks, without whole states or shadows
    whole = HostStore(
        discover(load_causal_lm(None, model_type="llama", tiny=True, seed=0)),
        compute_dtype=compute,
    )
    seen: list[tuple[int, set[str]]] = []

    def shard(master: torch.Tensor, **kw: Any) -> ShardedBlock:
        seen.append((master.numel(), set(kw)))
        return shard_master(master, **kw, rank=1, world=2, pin_memory=False)

    model = load_causal_lm(None, model_type="llama", tiny=True, seed=0)
    parts = HostStore(discover(model), compute_dtype=compute, shard=shard)
    keys = {"name", "entries", "decay_numel", "state_dtype", "master_dtype", "bf16", "grad_hold"}
    assert seen == [(b.numel, keys) for b in whole.blocks]
    for b, part in zip(whole.blocks, parts.blocks, strict=True):
        expect = shard_block(b, 1, 2, pin_memory=False)
        assert isinstance(part, ShardedBlock) and part.name == expect.name
        for t in ("master", "exp_avg", "exp_avg_sq", "shadow", "grad"):
            a, e = getattr(part, t), getattr(expect, t)
            assert (a is None and e is None) or torch.equal(a, e), t
        assert (part.numel, part.decay_numel, part.shard_offset, part.full_numel) == (
            expect.numel,
            expect.decay_numel,
            expect.shard_offset,
            expect.full_numel,
        )


def _loader() -> BatchLoader:
    samples = [
        Sample(np.array([i + 1, i + 2], dtype=np.int32), np.ones(2, dtype=bool)) for i in range(10)
    ]
    return BatchLoader(
        samples,
        rows=None,
        micro_batch_size=2,
        seq_len=8,
        pad_token_id=0,
        pad_to_multiple_of=1,
        shuffle=True,
        seed=3,
    )


def test_ranks_take_turns_over_one_stream_across_epochs() -> None:
    single = iter(_loader())  # one epoch: 5 micro-batches
    stream = [b.input_ids for b in single]
    stream += [b.input_ids for b in _loader_epoch(1)]
    ranks = [iter(RankLoader(_loader(), rank=r, world_size=2)) for r in range(2)]
    for i in range(5):  # 10 micro-batches: past the end of the first epoch
        for r in range(2):
            assert torch.equal(next(ranks[r]).input_ids, stream[2 * i + r])


def _loader_epoch(epoch: int) -> list[Batch]:
    loader = _loader()
    loader.epoch = epoch
    return list(loader)
