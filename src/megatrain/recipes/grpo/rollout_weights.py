"""The resident rollout's weight format (grpo.rollout_weights) and whether the loss corrects it.

Formats (model/quant_linear.py): "bf16", the store's compute dtype; "fp8" and "int8", the decoder
layers' linear weights in one byte per parameter and a float32 scale per output channel. The
rule of "auto" (recipes/grpo/plan.py applies it): the compute dtype when its resident rollout
fits beside the engine, else the compact format of this GPU (`compact_format`: fp8 where it
multiplies on fp8 tensor cores, else int8) when that fits, else the streamed path. A format
that is set is the only candidate. On the CPU "auto" is the compute dtype.

Importance sampling (`importance_sampling`): completions sampled from compact weights come from
a slightly different policy than the one the trainer scores; grpo.importance_sampling_correction
"auto" weights each token's loss by the truncated ratio (recipes/grpo/loss.py) exactly when the
rollout's weights are compact.
"""

from __future__ import annotations

import re

import torch

from megatrain.config.grpo import GRPOConfig
from megatrain.model.quant_linear import SCALED_MM_CAPABILITY, scaled_mm_capable
from megatrain.planning.builder import PlanBuilder

COMPUTE = "bf16"  # the choice that keeps the compute dtype
# GPUs with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell), by name, for
# plans made without the GPU at hand (`megatrain estimate` for an H100 on a laptop)
FP8_GPU_NAMES = re.compile(r"\b(G?H\d{2,3}|H800|L4|L40S?|G?B\d{3}|RTX (40|50)\d\d|Ada)\b")


def fp8_matmul(builder: PlanBuilder) -> bool:
    """Whether the run's GPU multiplies fp8 weights on fp8 tensor cores: this machine's device
    when it has one, else the planned GPU's name (Hardware.gpu_name)."""
    if not builder.placement.is_cuda:
        return False
    if torch.cuda.is_available():
        return scaled_mm_capable(builder.device)
    return FP8_GPU_NAMES.search(builder.hardware.gpu_name) is not None


def compact_format(builder: PlanBuilder) -> str:
    """The compact format "auto" falls back to on this GPU: fp8 with fp8 tensor cores, else
    int8 (both one byte per weight; int8 is dequantized per call)."""
    return "fp8" if fp8_matmul(builder) else "int8"


def candidates(builder: PlanBuilder) -> tuple[str, ...]:
    """The formats a resident rollout may take, in the order "auto" tries them."""
    setting = builder.cfg.grpo.rollout_weights
    if setting != "auto":
        return (setting,)
    if not builder.placement.is_cuda:
        return (COMPUTE,)
    return (COMPUTE, compact_format(builder))


def describe(weights: str, builder: PlanBuilder) -> str:
    """What a format keeps on the GPU, for the plan's line."""
    if weights == COMPUTE:
        dtype = str(builder.spec.compute_dtype).removeprefix("torch.")
        return f"every weight in {dtype}"
    cores = (
        "fp8 tensor cores"
        if weights == "fp8" and fp8_matmul(builder)
        else f"dequantized per call (no fp8 tensor cores below compute capability "
        f"{'.'.join(map(str, SCALED_MM_CAPABILITY))})"
        if weights == "fp8"
        else "dequantized per call"
    )
    return f"decoder linear weights {weights}, 1 B/param + a float32 scale per channel, {cores}"


def importance_sampling(g: GRPOConfig, weights: str) -> bool:
    """Whether the loss weights tokens by the truncated rollout importance ratio."""
    setting = g.importance_sampling_correction
    if isinstance(setting, bool):
        return setting
    return weights != COMPUTE
