"""The GRPO plan: the rollout phase's bytes and seconds from their formulas, the path it picks
(resident when it fits beside the engine, else streamed, else a clear refusal), and
`megatrain estimate --grpo` reporting it."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.distributed import Placement
from megatrain.planning import Hardware
from megatrain.planning.activations import layer_profile
from megatrain.planning.allocator_slack import SLACK_ITEM
from megatrain.planning.hardware import GIB, gib
from megatrain.planning.ranks import NVLINK_GBPS, ONE_PROCESS, Ranks
from megatrain.planning.rollout import SAMPLER_OPS, rollout_estimate
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.plan import (
    format_rollout,
    grpo_plan,
    rollout_margin,
    rollout_of,
    rollout_reserve,
    training_config,
)

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
    # the GPU tier's blocks are copied on the device (read + write at HBM bandwidth), the rest
    # over the host link; under W ranks each rank copies its shards and all-gathers them
    tier = 2 * spec.layers[0].params
    ranks = Ranks(nproc_per_node=2)
    for held, r in ((tier, ONE_PROCESS), (params, ONE_PROCESS), (tier, ranks)):
        mine = rollout_estimate(
            spec, hw, sequences=N, prompt_tokens=LP, completion_tokens=LC, tier_params=held, ranks=r
        )
        host = (params - held) * c
        link = host / r.world / (hw.h2d_gbps * 1e9) + host / 2 * (r.world - 1) / (NVLINK_GBPS * 1e9)
        assert mine.weight_copy_s == pytest.approx(link + 2 * held * c / hbm, rel=1e-12)
        assert mine.weight_copy_s < est.weight_copy_s


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
    # Against a reading of the free memory, half of memory.gpu_margin_gib's 2 GiB is kept
    # (MEASURED_MARGIN_SHARE): the plan's error on the engine's buffers is in the reading.
    margin = rollout_margin(big.cfg, measured=True)
    assert margin == GIB
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
    budget = big.hardware.gpu_bytes - persistent - rollout_margin(big.cfg, measured=False)
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
    reserved, the fewer blocks, and persistent buffers + the reservation always fit; the
    reason names the reservation. Where `auto` then keeps fewer blocks than fit, for a shorter
    predicted step (planning/gpu_share.py `trade_tier`), the count that fit fits beside the
    reservation too."""
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
        reason = plan.tier_reason or ""
        assert "left for the rollout" in reason, reason
        traded = re.search(r"\((\d+) fewer than fit", reason)
        if traded:  # the count that fit, before the trade: beside the reservation too
            fit = plan.gpu_state_blocks + int(traded[1])
            tier = ("--memory.gpu_state_blocks", str(fit))
            given = _builder(hw, *tier, reserve=lambda b, n=reserve: n).plan()
            assert given.estimate.gpu.persistent_bytes + reserve <= budget
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


# Qwen2's decoder layer: q, k, v, o, gate, up and down projections (weights [out, in]), the
# q, k, v biases and two norms; a compact rollout keeps the 7 weights in 1 B each
LINEAR_WEIGHTS = HIDDEN * HIDDEN * 2 + 2 * (KV_HEADS * HEAD_DIM) * HIDDEN + 3 * MLP * HIDDEN
OUT_CHANNELS = HIDDEN * 2 + 2 * KV_HEADS * HEAD_DIM + 2 * MLP + HIDDEN
OTHER = HIDDEN + 2 * KV_HEADS * HEAD_DIM + 2 * HIDDEN  # biases, norms: in the compute dtype


def test_compact_rollout_bytes_and_decoding_time() -> None:
    """fp8 / int8 weights: 1 B per linear weight + a float32 scale per output channel; a
    decoding step reads them (fp8 on fp8 tensor cores), int8 also writes and reads back the
    bf16 copy it dequantizes (2 x 2 B each), and each compact linear adds its own kernels."""
    hw = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)
    spec = _builder(hw).spec
    shape = dict(sequences=N, prompt_tokens=LP, completion_tokens=LC)
    est = {
        w: rollout_estimate(spec, hw, **shape, weights_format=w) for w in ("bf16", "fp8", "int8")
    }
    layer_bytes = LINEAR_WEIGHTS + 4 * OUT_CHANNELS + 2 * OTHER
    edges = (spec.embed_params + spec.head_params) * 2
    assert est["bf16"].gpu_items["weights"] == spec.total_params * 2
    assert est["bf16"].gpu_items["weights"] == edges + LAYERS * 2 * (LINEAR_WEIGHTS + OTHER)
    for fmt in ("fp8", "int8"):
        assert est[fmt].gpu_items["weights"] == edges + LAYERS * layer_bytes
        assert est[fmt].weights == fmt
    hbm, linears = hw.gpu_hbm_gbps * 1e9, 7 * LAYERS
    saved = (est["bf16"].gpu_items["weights"] - est["fp8"].gpu_items["weights"]) / hbm
    assert est["fp8"].decode_token_s == pytest.approx(
        est["bf16"].decode_token_s - saved + linears * 9 * hw.op_launch_s, rel=1e-9
    )
    dequant = 2 * LAYERS * LINEAR_WEIGHTS * 2 / hbm
    assert est["int8"].decode_token_s == pytest.approx(
        est["bf16"].decode_token_s - saved + dequant + linears * 3 * hw.op_launch_s, rel=1e-9
    )
    assert est["fp8"].weight_copy_s == est["bf16"].weight_copy_s  # the bf16 copy crosses


def test_plan_falls_back_to_compact_weights_and_says_why() -> None:
    """auto: bf16 while it fits; fp8 on an H100 (int8 without fp8 tensor cores) when only that
    fits; streamed when neither does. The plan prints the format and why, and turns on the
    truncated importance weights for the compact one."""
    h100 = _builder(Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB))
    margin = rollout_margin(h100.cfg, measured=True)
    roomy = grpo_plan(h100)
    assert roomy.rollout.weights == "bf16" and roomy.importance_cap is None
    assert "rollout weights: bf16 (every weight in bfloat16; grpo.rollout_weights: auto)" in (
        format_rollout(roomy)
    )
    bf16 = roomy.rollout.gpu_peak_bytes
    fp8 = rollout_of(h100, streamed=False, weights="fp8").gpu_peak_bytes
    assert fp8 < bf16
    tight = grpo_plan(h100, free_gpu_bytes=margin + bf16 - 1)
    assert tight.rollout.weights == "fp8" and not tight.rollout.streamed and tight.fits
    assert tight.rollout.gpu_peak_bytes == fp8 and tight.importance_cap == 2.0
    text = format_rollout(tight)
    budget = gib(bf16 - 1)
    assert (
        "rollout weights: fp8 (decoder linear weights fp8, 1 B/param + a float32 scale per "
        "channel, fp8 tensor cores; grpo.rollout_weights: auto, and bf16 needs "
        f"{gib(bf16)} of {budget})"
    ) in text
    assert "importance sampling: each token's loss x min(pi_old / pi_rollout, 2)" in text
    assert grpo_plan(h100, free_gpu_bytes=margin + fp8 - 1).rollout.streamed
    a100 = _builder(Hardware(gpu_name="NVIDIA A100-SXM4-80GB", gpu_bytes=80 * GIB))
    assert grpo_plan(a100, free_gpu_bytes=margin + bf16 - 1).rollout.weights == "int8"
    forced = _builder(h100.hardware, "--grpo.rollout_weights", "int8")
    assert grpo_plan(forced).rollout.weights == "int8"  # set: taken even where bf16 fits
    off = _builder(h100.hardware, "--grpo.importance_sampling_correction", "false")
    assert grpo_plan(off, free_gpu_bytes=margin + bf16 - 1).importance_cap is None
    on = _builder(h100.hardware, "--grpo.importance_sampling_correction", "true")
    assert grpo_plan(on).rollout.weights == "bf16" and grpo_plan(on).importance_cap == 2.0


def test_auto_gpu_tier_reserves_the_compact_rollout_when_bf16_cannot_fit() -> None:
    """The reserve is the first format whose rollout fits beside the untiered engine: bf16 on a
    roomy GPU, fp8 on one where only that fits, and the plan then generates with that format."""
    auto = ("--memory.gpu_state_blocks", "auto")
    roomy = _builder(Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB), *auto)
    room = roomy.hardware.gpu_bytes - 2 * GIB - _untiered_persistent(roomy)
    bf16 = rollout_of(roomy, streamed=False).gpu_peak_bytes
    fp8 = rollout_of(roomy, streamed=False, weights="fp8").gpu_peak_bytes
    assert rollout_reserve(roomy) == bf16 < room
    gpu_bytes = roomy.hardware.gpu_bytes - room + (bf16 + fp8) // 2  # room for fp8 only
    small = _builder(Hardware(gpu_bytes=gpu_bytes, host_bytes=512 * GIB), *auto)
    assert rollout_reserve(small) == fp8
    b = _builder(small.hardware, *auto, reserve=rollout_reserve)
    plan = grpo_plan(b)
    assert plan.rollout.weights == "fp8" and not plan.rollout.streamed
    # the rollout fits (this GPU is too small for the tiny model's training transients)
    assert not any("rollout phase" in problem for problem in plan.problems)


def _untiered_persistent(builder: RunBuilder) -> int:
    no_share = ("--optimizer.gpu_update_blocks", "0")  # as rollout_reserve's room
    cfg = training_config(load_config(None, [*MODEL, *GRPO, *no_share]))
    untiered = RunBuilder(cfg, hardware=builder.hardware, placement=builder.placement)
    return untiered.plan().estimate.gpu.persistent_bytes
