"""examples/qwen3_5_27b_grpo.yaml: the plan of the Qwen3.5-27B GRPO shape on one H100 80GB and a
251 GiB host (`megatrain estimate --grpo --gpu-gib 79.2 --host-gib 251`): it fits, the bf16
rollout does not fit beside the engine and the fp8 one does, and the header's figures are the
plan's."""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain.config import load_config
from megatrain.config.sections import PLANNED_BATCH
from megatrain.distributed import Placement
from megatrain.planning import Hardware
from megatrain.planning.hardware import gib
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.plan import grpo_plan, rollout_of, rollout_reserve, training_config

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "qwen3_5_27b_grpo.yaml"


def test_the_27b_example_plans_an_fp8_rollout_on_one_h100() -> None:
    cfg = training_config(load_config(EXAMPLE, base=PLANNED_BATCH))  # as megatrain grpo loads it
    hw = Hardware().with_overrides(gpu_gib=79.2, host_gib=251)
    builder = RunBuilder(
        cfg, hardware=hw, placement=Placement(torch.device("cuda")), gpu_reserve=rollout_reserve
    )
    plan = grpo_plan(builder)
    assert plan.fits and plan.rollout.weights == "fp8" and not plan.rollout.streamed
    assert plan.importance_cap == 2.0
    assert plan.rollout.sequences == 64 and plan.rollout.completion_tokens == 1024
    # micro-batch auto: none fits with every layer input on the GPU; with them on the host 32
    assert (plan.training.micro_batch_size, plan.training.grad_accum) == (32, 2)
    bf16 = rollout_of(builder, streamed=False)
    free = hw.gpu_bytes - plan.training.estimate.gpu.persistent_bytes - 2 * 2**30
    assert plan.rollout.gpu_peak_bytes <= free < bf16.gpu_peak_bytes
    header = "\n".join(line for line in EXAMPLE.read_text().splitlines() if line.startswith("#"))
    estimate = plan.training.estimate
    for figure in (
        estimate.host.total_bytes,
        estimate.gpu.peak_bytes,
        bf16.gpu_peak_bytes,
        plan.rollout.gpu_peak_bytes,
    ):
        assert gib(figure) in header, gib(figure)
