"""PlanBuilder.step_up: back to the plan before a transient step-down (recipes/oom.py),
leaving free the GPU memory the process came to hold outside PyTorch's allocator (kernels a
package autotuned), planned for an H100 without one."""

from __future__ import annotations

import dataclasses

import torch

from megatrain.config.shorthand import shorthand_config
from megatrain.distributed import Placement
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import GIB, Hardware

# a Qwen2.5-7B shape (a small vocabulary): 17 of 30 tier blocks on an 80 GiB card, 15 with
# 6 GiB more margin, 14 with 10 more
SHAPE = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}


def _builder(**memory: object) -> PlanBuilder:
    values: dict[str, object] = {
        "model.model_type": "qwen2",
        "model.random_init": True,
        "data.stage": "pt",
        "data.cutoff_len": 2048,
        "training.seq_len": 2048,
        "training.micro_batch_size": 4,
        **{f"model.config_overrides.{k}": v for k, v in SHAPE.items()},
        **{f"memory.{k}": v for k, v in memory.items()},
    }
    cfg = shorthand_config(None, values=values)
    return PlanBuilder(cfg, hardware=Hardware(), placement=Placement(torch.device("cuda")))


def test_step_up_goes_back_to_the_plan_before_the_step_down() -> None:
    builder = _builder()
    planned, tier = builder.cfg.memory, builder.engine_plan().gpu_state_blocks
    down = builder.step_down(GIB)
    assert down is not None and down.after.gpu_state_blocks < tier
    up = builder.step_up(planned)
    assert up is not None and up.before == down.after
    assert builder.engine_plan().gpu_state_blocks == tier
    assert builder.cfg.memory == planned


def test_step_up_leaves_free_what_kernels_hold_outside_the_allocator() -> None:
    """With 6 GiB more held outside the allocator the plan goes up to the count "auto" picks
    with 6 GiB more margin; with more than the card, it stays down and says so (None)."""
    builder = _builder()
    planned, tier = builder.cfg.memory, builder.engine_plan().gpu_state_blocks
    wider = dataclasses.replace(planned, gpu_margin_gib=planned.gpu_margin_gib + 6)
    expected = _builder(gpu_margin_gib=wider.gpu_margin_gib).engine_plan().gpu_state_blocks
    down = builder.step_down(10 * GIB)
    assert down is not None
    smaller = down.after.gpu_state_blocks
    assert smaller < expected < tier  # the test's premise: the three differ
    up = builder.step_up(planned, 6 * GIB)
    assert up is not None and up.after.gpu_state_blocks == expected
    assert up.margin_gib[1] == wider.gpu_margin_gib
    builder.step_down(10 * GIB)
    current = builder.cfg
    assert builder.step_up(planned, 200 * GIB) is None
    assert builder.cfg == current  # nothing changed
