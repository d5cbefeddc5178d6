"""The step time of memory-bound layers (planning/timing.py `_layer_s`, planning/traffic.py)
against the H100 runs of docs/performance.md: the rows of run 32 and run 35 as the estimator
sees them on the assumed H100 test host (no GPU needed), 64k tokens a step (32 pre-training rows
of 2048, micro-batch 4), clipping 1.0, bf16. A check of the model against recorded
measurements, not a timing of this machine."""

from __future__ import annotations

import pytest
import torch

from megatrain.config.shorthand import shorthand_config
from megatrain.distributed import Placement
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import Hardware

H100 = Hardware().with_overrides(gpu_gib=79.2, host_gib=125)
QWEN35_27B_16 = dict(  # bench/common.py "qwen3.5-27b", cut to 16 layers (12 linear + 4 full)
    model_type="qwen3_5_text",
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    vocab_size=248320,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
)
QWEN3_30B_A3B_12 = dict(  # bench/common.py "qwen3-30b-a3b", cut to 12 layers
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=12,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
)
LLAMA31_8B = dict(  # bench/common.py "llama3.1-8b"
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131072,
)


def _step_s(shape: dict[str, object], compiled: bool) -> float:
    overrides = {k: v for k, v in shape.items() if k != "model_type"}
    values = {
        "model.model_type": shape["model_type"],
        "model.random_init": True,
        "data.stage": "pt",
        "data.cutoff_len": 2048,
        "training.seq_len": 2048,
        "training.micro_batch_size": 4,
        "training.gradient_accumulation_steps": 8,
        "optimizer.max_grad_norm": 1.0,
        "training.compile_layers": compiled,
        **{f"model.config_overrides.{k}": v for k, v in overrides.items()},
    }
    cfg = shorthand_config(None, values=values)
    builder = PlanBuilder(cfg, hardware=H100, placement=Placement(torch.device("cuda")))
    return builder.plan(layout="full").estimate.time.step_s


@pytest.mark.parametrize(
    ("shape", "compiled", "measured", "within"),
    [
        (QWEN35_27B_16, False, 17.51, 0.25),  # run 35 (and 32): torch's Gated DeltaNet fallback
        (QWEN35_27B_16, True, 11.36, 0.25),  # run 32, compile_layers: true
        (QWEN3_30B_A3B_12, False, 3.58, 0.10),  # run 35
        (LLAMA31_8B, True, 7.16, 0.05),  # runs 32 and 35
    ],
)
def test_step_time_matches_the_h100_runs(
    shape: dict[str, object], compiled: bool, measured: float, within: float
) -> None:
    predicted = _step_s(shape, compiled)
    assert abs(predicted / measured - 1) <= within, (predicted, measured)
