"""The GRPO plan: the rollout phase's bytes and seconds from their formulas, the path it picks
(resident when it fits beside the engine, else streamed, else a clear refusal), and
`megatrain estimate --grpo` reporting it."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.distributed import Placement
from megatrain.planning import Hardware
from megatrain.planning.activations import layer_profile
from megatrain.planning.allocator_slack import SLACK_ITEM
from megatrain.planning.hardware import GIB
from megatrain.planning.rollout import SAMPLER_OPS, rollout_estimate
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.plan import grpo_plan, rollout_reserve, training_config

# Qwen2 shape: 3 layers, 4 query heads, 2 key/value heads of width 16 (hidden 64).
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 3, 2, 16, 64, 96, 512
MODEL = [
    *("--model.model_type", "qwen2", "--model.tiny", "true", "--model.tokenizer", "demo"),
    *("--model.compute_dtype", "bf16"),
    *("--model.config_overrides.num_hidden_layers", str(LAYERS)),
    *("--model.config_overrides.num_attention_heads", "4"),
    *("--model.config_overrides.num_key_value_heads", str(KV_HEADS)),
    *("--model.config_overrides.hidden_size", str(HIDDEN)),
    *("--model.config_overrides.intermediate_size", str(MLP)),
    *("--model.config_overrides.vocab_size", str(VOCAB)),
]
GRPO = [
    *("--grpo.prompts_per_step", "3", "--grpo.num_generations", "4"),
    *("--grpo.max_prompt_length", "40", "--grpo.max_completion_length", "24"),
    *("--training.seq_len", "64", "--data.cutoff_len", "64", "--training.micro_batch_size", "4"),
    *("--memory.gpu_state_blocks", "0"),
]
N, LP, LC = 12, 40, 24


def _builder(hw: Hardware, *extra: str, reserve: Any = None) -> RunBuilder:
    cfg = training_config(load_config(None, [*MODEL, *GRPO, *extra]))
    placement = Placement(torch.device("cuda"))
    return RunBuilder(cfg, hardware=hw, placement=placement, gpu_reserve=reserve)


def test_rollout_bytes_and_seconds_follow_their_formulas() -> None:
    hw = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)
    spec = _builder(hw).spec
    c = 2  # bf16
    params = spec.total_params
    est = rollout_estimate(spec, hw, sequences=N, prompt_tokens=LP, completion_tokens=LC)
    kv_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * c  # key + value, every layer
    assert est.gpu_items == {
        "weights": params * c,
        "KV cache": N * (LP + LC) * kv_token,
        "logits + sampler scores": N * VOCAB * (c + 8),
        "prefill transient (one MLP)": N * LP * (2 * MLP + HIDDEN) * c,
        # the largest transient tensor: one MLP intermediate or the fp32 scores
        SLACK_ITEM: max(N * LP * MLP * c, N * VOCAB * 4),
    }
    cpu = rollout_estimate(
        spec, hw, sequences=N, prompt_tokens=LP, completion_tokens=LC, cuda=False
    )
    assert cpu.gpu_items[SLACK_ITEM] == 0  # no caching allocator off CUDA
    hbm, rate = hw.gpu_hbm_gbps * 1e9, hw.flops_per_s(torch.bfloat16, HIDDEN)
    ops = sum(f for f, _ in layer_profile(spec, 1, 16, "padded").ops) + SAMPLER_OPS
    decode = (
        max(params * c / hbm, 2.0 * params * N / rate)
        + N * (LP + LC // 2) * kv_token / hbm
        + ops * hw.op_launch_s
    )
    assert est.decode_token_s == pytest.approx(decode, rel=1e-12)
    copy, prefill = params * c / (hw.h2d_gbps * 1e9), 2.0 * params * N * LP / rate
    assert est.rollout_s == pytest.approx(copy + prefill + LC * decode, rel=1e-12)
    assert est.tokens_per_s == pytest.approx(N * LC / est.rollout_s, rel=1e-12)
    streamed = rollout_estimate(
        spec, hw, sequences=N, prompt_tokens=LP, completion_tokens=LC, streamed=True, num_slots=2
    )
    resident_blocks = spec.embed_params + spec.head_params + 2 * spec.layer_params_max
    assert streamed.gpu_items["weights"] == resident_blocks * c
    layers = sum(la.params for la in spec.layers) * c
    assert streamed.decode_token_s == pytest.approx(
        max(resident_blocks * c / hbm + layers / (hw.h2d_gbps * 1e9), 2.0 * params * N / rate)
        + N * (LP + LC // 2) * kv_token / hbm
        + ops * hw.op_launch_s,
        rel=1e-12,
    )
    assert streamed.weight_copy_s == 0.0


def test_plan_picks_resident_then_streamed_then_refuses() -> None:
    bf16 = ("--grpo.rollout_weights", "bf16")  # no compact fallback (see the test below)
    big = _builder(Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB), *bf16)
    plan = grpo_plan(big)
    assert not plan.rollout.streamed and plan.fits
    assert plan.training.tokens_per_step == N * 64  # 12 rows of 64 tokens, 3 micro-batches
    persistent = plan.training.estimate.gpu.persistent_bytes
    resident = plan.rollout.gpu_peak_bytes
    streamed_peak = grpo_plan(big, free_gpu_bytes=0).rollout.gpu_peak_bytes
    assert streamed_peak < resident
    margin = 2 * GIB  # memory.gpu_margin_gib's default
    # Free memory just below the resident rollout: streamed; below the streamed one: refused.
    assert grpo_plan(big, free_gpu_bytes=margin + resident).rollout.streamed is False
    tight = grpo_plan(big, free_gpu_bytes=margin + resident - 1)
    assert tight.rollout.streamed and tight.fits
    refused = grpo_plan(big, free_gpu_bytes=margin + streamed_peak - 1)
    assert refused.rollout.streamed and not refused.fits
    assert "grpo.max_completion_length" in refused.problems[-1]
    with pytest.raises(ValueError, match="this GRPO run does not fit"):
        refused.require_fit()
    forced = _builder(big.hardware, *bf16, "--grpo.generation", "streamed")
    assert grpo_plan(forced).rollout.streamed
    # Without a device reading, the free memory is the GPU less the engine's persistent buffers.
    budget = big.hardware.gpu_bytes - persistent - margin
    assert grpo_plan(big).rollout.gpu_peak_bytes <= budget


def test_estimate_command_reports_the_rollout_phase(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model-type", "qwen2", "--seq-len", "64", "--gpu-gib", "80"]
    assert main([*args, "--grpo", "--json", *MODEL[2:], *GRPO]) == 0
    report = json.loads(capsys.readouterr().out)
    kv_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    assert report["grpo"]["kv_cache_bytes"] == N * (LP + LC) * kv_token
    assert report["grpo"]["step_s"] == pytest.approx(
        report["grpo"]["rollout_s"] + report["time"]["step_s"], rel=1e-12
    )
    assert main([*args, "--grpo", *MODEL[2:], *GRPO]) == 0
    assert "GRPO rollout phase (whole model on the GPU" in capsys.readouterr().out


def test_cpu_estimate_puts_the_rollout_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    cpu = ["--training.device", "cpu"]
    args = ["estimate", "--model-type", "qwen2", "--seq-len", "64", "--grpo", *cpu]
    assert main([*args, *MODEL[2:], *GRPO]) == 0
    out = capsys.readouterr().out
    assert "GRPO rollout phase (whole model on the CPU: a CPU run streams nothing)" in out
    assert "whole model on the GPU" not in out


def test_auto_gpu_tier_leaves_the_resident_rollout_its_room() -> None:
    """The automatic GPU tier is chosen around the room reserved for the rollout: the more is
    reserved, the fewer blocks, and persistent buffers + the reservation always fit."""
    hw = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)
    auto = ("--memory.gpu_state_blocks", "auto")
    whole = _builder(hw, *auto).plan()
    assert whole.gpu_state_blocks == LAYERS + 2  # room for every block's states
    budget = hw.gpu_bytes - 2 * GIB  # memory.gpu_margin_gib's default
    tiers = []
    for left in (0.0, 0.3, 0.6):  # of a full tier's persistent bytes, taken by the reserve
        full = whole.estimate.gpu.persistent_bytes
        reserve = budget - full + int(left * full)
        plan = _builder(hw, *auto, reserve=lambda b, n=reserve: n).plan()
        assert plan.estimate.gpu.persistent_bytes + reserve <= budget
        assert "left for the rollout" in (plan.tier_reason or "")
        tiers.append(plan.gpu_state_blocks)
    assert tiers[0] == LAYERS + 2 and tiers[-1] < LAYERS + 2
    assert tiers == sorted(tiers, reverse=True)
    # a GRPO run's builder reserves the resident rollout when the tier is automatic
    b = _builder(hw, *auto, reserve=rollout_reserve)
    plan = grpo_plan(b)
    assert not plan.rollout.streamed
    assert b.gpu_reserve_bytes == plan.rollout.gpu_peak_bytes
    assert "left for the rollout" in (plan.training.tier_reason or "")


def test_the_training_config_is_one_generation_batch_of_rows_as_long_as_they_get() -> None:
    """One generation batch (12 sequences) is one optimizer step in micro-batches of 4 rows,
    each row at most 40 + 24 tokens (rounded up to data.pad_to_multiple_of, 8); the engine's
    plan is the GRPO plan (the engine once planned one micro-batch a step: more GPU-tier blocks
    than the plan printed, docs/performance.md run 45)."""
    cfg = training_config(load_config(None, [*MODEL, *GRPO]))
    assert cfg.training.gradient_accumulation_steps == 3
    assert cfg.seq_len == 64 and cfg.data.cutoff_len == 64
    odd = training_config(load_config(None, [*MODEL, *GRPO, "--grpo.max_completion_length", "30"]))
    assert odd.seq_len == 72  # 70 rounded up to 8
    assert training_config(cfg) == cfg
    b = _builder(Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB), reserve=rollout_reserve)
    assert b.engine_plan() == grpo_plan(b).training.engine
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2: .* 3 of them"):
        training_config(
            load_config(None, [*MODEL, *GRPO, "--training.gradient_accumulation_steps", "2"])
        )
