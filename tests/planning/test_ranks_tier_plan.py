"""What the estimate and the plan say about the GPU tier under ranks (engine/tier.py).

Qwen2.5-7B shape (28 equal layers, untied), bf16 compute, fp32 states. With W ranks a tier
block keeps, on each rank's GPU, the rank's shard of its fp32 master, m and v (12 bytes per
shard parameter; a shard is the block padded to whole W x 2048 runs, over W) and the whole
block's bf16 weights (2 bytes per parameter); the node's host keeps nothing of it. Its gradient
is reduce-scattered as a streamed block's and lands (bf16) in the shard's part of its weights,
which the update rewrites; its update is the shard's GPU AdamW and an all-gather of the new
weights; its weights are never copied up nor gathered for a layer's use.
So the expected numbers are sums of shard sizes and the estimate's own rates, exactly.
"""

from __future__ import annotations

import pytest
from transformers import Qwen2Config

from megatrain.engine.layout import TIER
from megatrain.planning import Estimate, Hardware, model_spec
from megatrain.planning.hardware import GIB
from megatrain.planning.plan import plan_resources
from megatrain.planning.ranks import NCCL_GPU_GIB, Ranks
from megatrain.planning.run_shape import RunShape
from megatrain.planning.spec import ModelSpec
from megatrain.planning.timing import GPU_ADAMW_GPARAMS_S
from megatrain.store.states import QUANT_BLOCK
from predict import ranks_estimate
from shapes import QWEN25_7B as QWEN7B

HW = Hardware(host_bytes=512 * GIB)
TIER_ITEM = TIER


@pytest.fixture(scope="module")
def qwen7b() -> ModelSpec:
    return model_spec(Qwen2Config(**QWEN7B))


def _est(spec: ModelSpec, ranks: Ranks, tier: int) -> Estimate:
    return ranks_estimate(spec, ranks, HW, tier)


def _shard(numel: int, world: int) -> int:
    per = world * QUANT_BLOCK
    return -(-numel // per) * per // world


@pytest.mark.parametrize("world", [2, 4])
def test_tier_states_are_sharded_and_weights_whole(qwen7b: ModelSpec, world: int) -> None:
    k, layer = 5, qwen7b.layers[0].params
    base, tier = _est(qwen7b, Ranks(world), 0), _est(qwen7b, Ranks(world), k)
    # whole weights over the padded layout (store/shard.py), states over the shard
    padded = world * _shard(layer, world)
    assert tier.gpu.items[TIER_ITEM] == k * (2 * padded + 12 * _shard(layer, world))
    # the shared fp32 accumulators still take every layer's gradient (tier ones included)
    key = "gradient accumulators (fp32)"
    assert tier.gpu.items[key] == base.gpu.items[key] == 2 * 4 * padded
    # per node: its `world` ranks no longer hold their 14-byte shards of the tier layers
    assert base.host.total_bytes - tier.host.total_bytes == world * k * 14 * _shard(layer, world)
    # while loading, each tier shard goes to the GPU as it is built: a rank that has loaded
    # holds its shards outside the tier, the loading one at most that or its fp32 model
    saved = (base.host.total_bytes - tier.host.total_bytes) // world  # a rank's
    rank = (base.host.pageable_bytes + base.host.pinned_reserved_bytes) // world
    model = 4 * qwen7b.total_params
    loader = max(model, rank) - max(model, rank - saved)
    assert base.host.load_peak_bytes - tier.host.load_peak_bytes == (world - 1) * saved + loader
    whole = _est(qwen7b, Ranks(world), 30)  # 28 layers, embedding, head
    assert whole.settings["num_slots"] == 0 and whole.time.optimizer_s == 0.0
    # the tier embedding is resident: the forward gathers no table
    assert "all-gathered embedding table (ranks)" not in whole.gpu.items


def test_tier_under_ranks_swaps_host_updates_for_gpu_ones(qwen7b: ModelSpec) -> None:
    ranks, k, layer = Ranks(2), 6, qwen7b.layers[0].params
    base, tier = _est(qwen7b, ranks, 0).time, _est(qwen7b, ranks, k).time
    shard, node_rate = _shard(layer, 2), HW.optimizer_gparams_s * 1e9 / 2  # 2 ranks share it
    assert tier.optimizer_s == pytest.approx(base.optimizer_s - k * shard / node_rate, rel=1e-9)
    gather = ranks.collective_s(2 * layer)  # the updated bf16 weights, once per step
    assert tier.gpu_optimizer_s == pytest.approx(
        k * (shard / (GPU_ADAMW_GPARAMS_S * 1e9) + gather), rel=1e-12
    )
    # a streamed layer is gathered twice per step, a tier layer once (after its update)
    assert base.collective_s - tier.collective_s == pytest.approx(k * gather, rel=1e-9)
    assert tier.step_s < base.step_s  # 8k tokens per rank wait on the CPU optimizer


def _plan(spec: ModelSpec, world: int, tier: int | str = "auto") -> tuple[int, Estimate]:
    shape = RunShape(2048, 2, "full", 1.0, None, True, True, "fp32", tier, ranks=Ranks(world))
    plan = plan_resources(
        spec,
        shape,
        hardware=Hardware(),
        micro_batch_size=4,
        grad_accum=1,
        gpu_margin_gib=2,
        host_margin_gib=4,
    )
    return plan.gpu_state_blocks, plan.estimate


def test_auto_picks_a_tier_per_rank(qwen7b: ModelSpec) -> None:
    """8k tokens per GPU on 80 GiB H100s: one process keeps some layers' states on its GPU,
    and one block more would not fit with the 2 GiB margin; two ranks, holding half of each
    tier block's states, keep more, each rank's predicted peak fitting with the margin plus
    NCCL's share (ranks.py NCCL_GPU_GIB), up to every block (bf16 compute: 12 bytes per shard
    parameter + 2 per whole one, so all 30 fit); the optimizer split over the ranks' CPU and
    GPUs makes each GPU's predicted tokens/s the larger."""
    blocks = qwen7b.num_layers + 2
    one, one_est = _plan(qwen7b, 1)
    two, est = _plan(qwen7b, 2)
    assert 0 < one < two <= blocks
    one_budget = Hardware().gpu_bytes - 2 * GIB
    assert one_est.gpu.peak_bytes <= one_budget < _plan(qwen7b, 1, one + 1)[1].gpu.peak_bytes
    budget = Hardware().gpu_bytes - (2 + NCCL_GPU_GIB) * GIB
    assert est.gpu.peak_bytes <= budget
    assert two == blocks or budget < _plan(qwen7b, 2, two + 1)[1].gpu.peak_bytes
    assert est.time.tokens_per_s / 2 > one_est.time.tokens_per_s
