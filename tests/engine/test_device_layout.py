"""The planner's GPU buffers are the engine's (engine/layout.py): the drift check.

For dense, MoE, hybrid and tied models, with and without a GPU tier (a few layers; every
block), tiled MLPs, in bf16 and fp32 compute, the `DeviceLayout` the planner builds from the
model's config alone (meta device, planning/spec.py) equals, buffer by buffer and byte for
byte, the persistent tensors a real engine holds once built (`StreamingEngine.device_buffers`).
On the CPU the engine runs the GPU tier's code path, so every buffer exists here too.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.engine.engine import StreamingEngine
from megatrain.engine.gpu_share import BlockFormats
from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.layout import (
    TIER,
    VISION,
    VISION_GRAD,
    VISION_TRAIN,
    BlockSizes,
    DeviceLayout,
    held_bytes,
)
from megatrain.engine.plan import EnginePlan, tier_size
from megatrain.engine.tiling import TilePolicy, untiled_layers
from megatrain.model.loading import load_causal_lm, load_config
from megatrain.model.multimodal import trained_vision
from megatrain.model.structure import discover
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.planning import model_spec
from megatrain.planning.spec import block_sizes
from megatrain.store.host import HostStore

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.yaml"
MODELS = ["llama", "qwen3_moe", "qwen3_next", "qwen3", "qwen2_5_vl"]  # dense, MoE, hybrid, tied
# (tiny qwen3), vision-language (the vision modules resident, frozen)


def _plan(num_layers: int, tier: int, tiles: int | None, untiled: frozenset[int]) -> EnginePlan:
    return EnginePlan(
        num_slots=2,
        clip_norm=1.0,
        loss_chunk_tokens=default_chunk_tokens(256),
        gpu_state_blocks=min(tier, tier_size(num_layers)),
        tiles=None if tiles is None else TilePolicy(tiles),
        untiled=untiled if tiles is not None else frozenset(),
    )


def _held(structure: Any, store: HostStore, plan: EnginePlan) -> dict[str, int]:
    """The bytes by layout name of the device tensors an engine running `plan` holds."""
    engine = StreamingEngine(structure, store, CpuAdamW(AdamWHyper()), plan)
    try:
        return held_bytes(engine.device_buffers())
    finally:
        engine.close()


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_layout_is_what_the_engine_holds(model_type: str, dtype: str) -> None:
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    spec = model_spec(load_config(None, model_type=model_type, tiny=True), dtype)
    n = spec.num_layers
    for tier, tiles in ((0, None), (1, 2), (n, None), (99, None)):
        structure = discover(load_causal_lm(None, model_type=model_type, tiny=True))
        store = HostStore(structure, compute_dtype=torch_dtype, pin_memory=False)
        plan = _plan(n, tier, tiles, untiled_layers(structure))
        assert untiled_layers(spec.structure) == untiled_layers(structure)
        planned = DeviceLayout.of(plan, block_sizes(spec), torch_dtype)
        assert block_sizes(spec) == BlockSizes.of_store(store, structure.tied)
        held = _held(structure, store, plan)
        assert held == planned.bytes_by_name(), (model_type, dtype, tier, tiles)
        if tier:
            assert held[TIER] > 0
        assert sum(held.values()) == planned.total_bytes


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_a_compressed_tier_is_what_the_engine_holds(states: str) -> None:
    """bf16 and int8 states in the tier, as stored (int8: codes and their scales)."""
    spec = model_spec(load_config(None, model_type="llama", tiny=True), "bf16")
    structure = discover(load_causal_lm(None, model_type="llama", tiny=True))
    store = HostStore(structure, compute_dtype=torch.bfloat16, pin_memory=False, state_dtype=states)
    plan = _plan(spec.num_layers, 99, None, frozenset())
    formats = BlockFormats(store.master_dtype, store.state_dtype, store.grad_hold)
    planned = DeviceLayout.of(plan, block_sizes(spec), torch.bfloat16, formats)
    held = _held(structure, store, plan)
    assert held == planned.bytes_by_name()
    fp32 = DeviceLayout.of(plan, block_sizes(spec), torch.bfloat16).bytes_by_name()[TIER]
    assert held[TIER] < fp32  # 18 B/param with fp32 states; 14 bf16, about 12 int8


_RANK_SCRIPT = """
import sys
from megatrain.config import load_config
from megatrain.engine.layout import DeviceLayout, held_bytes
from megatrain.planning.spec import block_sizes
from megatrain.recipes.builder import RunBuilder

for tier in (0, 2, 99):
    cfg = load_config(sys.argv[1], ["--memory.gpu_state_blocks", str(tier),
                                    "--training.device", "cpu"])
    b = RunBuilder(cfg)
    structure, store = b.model_and_store()
    engine = b.engine(structure, store)
    planned = DeviceLayout.of(engine.plan, block_sizes(b.spec), store.compute_dtype)
    held = held_bytes(engine.device_buffers())
    engine.close()
    assert held == planned.bytes_by_name(), (tier, held, planned.bytes_by_name())
print("layout ok on rank", b.placement.rank)
"""


def test_layout_under_two_ranks(tmp_path: Path) -> None:
    """Sharded (gloo, 2 ranks): padded layouts, the gathered embedding table, a tier of shard
    states with whole weights, the shared accumulators over every layer."""
    script = tmp_path / "layout.py"
    script.write_text(_RANK_SCRIPT)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        str(script), str(DEMO),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MEGATRAIN_COLLECTIVE_TIMEOUT_S="120")
    env.pop("WORLD_SIZE", None)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "layout ok on rank 0" in run.stdout  # rank 1 is quiet; its assert sets the code


@pytest.mark.parametrize(("tower", "projector"), [(True, True), (False, True)])
def test_layout_of_trained_vision_modules(tower: bool, projector: bool) -> None:
    """Trained vision parts: their weights and fp32 gradient on the device, the rest frozen."""
    spec = model_spec(load_config(None, model_type="qwen2_5_vl", tiny=True), "bf16")
    structure = discover(load_causal_lm(None, model_type="qwen2_5_vl", tiny=True))
    trained = trained_vision(structure, tower=tower, projector=projector)
    store = HostStore(structure, compute_dtype=torch.bfloat16, pin_memory=False, vision=trained)
    plan = dataclasses.replace(
        _plan(spec.num_layers, 0, None, frozenset()),
        train_vision=tower,
        train_projector=projector,
    )
    planned = DeviceLayout.of(plan, block_sizes(spec), torch.bfloat16)
    held = _held(structure, store, plan)
    assert held == planned.bytes_by_name()
    assert held[VISION_TRAIN] > 0 and held[VISION_GRAD] == 2 * held[VISION_TRAIN]
    assert (VISION in held) == (not tower)
