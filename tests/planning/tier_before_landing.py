"""The GPU bytes the engine of docs/performance.md's measured runs held that today's does not.

Those runs were measured before a GPU-tier block's gradient landed in its own bf16 weights
(engine/tier.py "Gradient"). In bf16 compute that engine held, beyond today's layout
(engine/layout.py) of the same plan: an fp32 gradient over each tier block's parameters (its
shard's under ranks), 4 B/param; on one process no head or embedding fp32 gradient buffer for a
tier head or embedding (the tier block owned its gradient; today's engine has the buffer); two
fp32 gradient accumulators and two bf16 staging copies of them, on one process sized over the
streamed layers only (today's: over every layer, and one accumulator and no staging where no
layer streams). fp32 compute on one process is unchanged.

A row test that compares a plan's GPU peak with the one such a run measured adds
`held_before_landing` to the plan's: persistent buffers add to every phase alike, so the peak's
phase is the same and the sum is the peak that engine's plan had.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.engine.layout import ACCUMULATORS, EMBED_GRAD, HEAD_GRAD, STAGING, DeviceLayout
from megatrain.engine.plan import EnginePlan, tier_order
from megatrain.model.loading import load_config
from megatrain.planning import model_spec
from megatrain.planning.estimate import GpuMemory
from megatrain.planning.spec import ModelSpec, block_sizes
from megatrain.store.shard import padded_numel

TIER_GRADIENT = "GPU tier: fp32 gradient"  # a part of the tier's bytes, not a buffer of its own


def row_spec(shape: dict[str, Any]) -> ModelSpec:
    """The model of a bench/cli_train.py row (predict.py `cli_row_plan`), bf16 compute."""
    overrides = {k: v for k, v in shape.items() if k != "model_type"}
    return model_spec(load_config(None, model_type=shape["model_type"], overrides=overrides))


def held_before_landing(spec: ModelSpec, engine: EnginePlan, gpu: GpuMemory) -> int:
    """Bytes the engine before the tier's gradient landed in its weights held for `engine`'s
    plan of `spec` beyond today's layout of it; `gpu`, the plan's estimate, checks that the
    layout below is the one it summed."""
    now = DeviceLayout.of(engine, block_sizes(spec), spec.compute_dtype).bytes_by_name()
    before = _before(spec, engine)
    for name in before:
        if name != TIER_GRADIENT:
            assert gpu.items.get(name, 0) == now.get(name, 0), (name, gpu.items, now)
    return sum(before.values()) - sum(now.get(name, 0) for name in before)


def _before(spec: ModelSpec, engine: EnginePlan) -> dict[str, int]:
    """Those buffers' bytes in that engine (engine/layout.py as it was)."""
    world, bf16 = engine.world_size, spec.compute_dtype == torch.bfloat16
    sizes = block_sizes(spec)
    padded = [padded_numel(n, world) for n in tier_order(sizes.layers, sizes.embed, sizes.head)]
    *layers, embed, head = padded
    tier = min(engine.gpu_state_blocks, len(padded))
    streamed = layers[tier:]  # tier order: the layers first, then the embedding, the head
    acc = max(layers if world > 1 else streamed, default=0)
    owns = world == 1  # a tier block owned its fp32 gradient (several ranks: its shard's)
    return {
        ACCUMULATORS: 2 * acc * 4,
        STAGING: 2 * acc * 2 if bf16 else 0,
        HEAD_GRAD: 0 if tier == len(padded) and owns else 4 * head,
        EMBED_GRAD: 0 if tier >= len(padded) - 1 and owns else 4 * embed,
        TIER_GRADIENT: sum(4 * (n // world) for n in padded[:tier]) if bf16 else 0,
    }
