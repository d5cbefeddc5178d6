"""The plan of a model with attention sinks (GPT-OSS) runs what the engine runs: on CUDA flex
attention over the key blocks the mask keeps (model/flex_sinks.py) at its head dims, else sdpa
with the sink as an extra key (model/sink_attention.py), unless eager is asked for.

The spec records flex's layers as FLEX_SINKS (the key blocks flex visits, at its fitted rate:
the 4-layer row of run 78) and the sdpa path's as "sinks" (the tiny config's head dim 16);
the latter's attention counts the whole row's FLOPs (the kernel runs under a mask, which skips
no block) and the fused kernels' recompute + backward;
on meta the layer runs sdpa's memory-efficient op (head dim 64 + 1 padded to 72, with a mask),
so at the GPT-OSS-20B shape no [B, H, S, S] score tensor exists, and the layer's and the row's
GPU peaks drop by the score tensors the eager layer holds.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

from megatrain.choices import SINK_ATTENTION
from megatrain.model.tiny import tiny_config
from megatrain.planning import Hardware, model_spec
from megatrain.planning.activations import attention_workspace, layer_profile
from megatrain.planning.estimate import COMPILED_EAGER_SCORES
from megatrain.planning.layer_time import (
    ATTENTION_RECOMPUTE_BACKWARD,
    FLEX_RATE_FRACTION,
    attention_flops_per_token,
)
from megatrain.planning.spec import FLEX_SINKS
from predict import cli_row_plan
from shapes import GPT_OSS_20B

ROWS, SEQ = 4, 2048  # the bench rows: micro-batches of 4 x 2048


def test_the_spec_records_sinks_unless_eager_is_asked_for() -> None:
    spec = model_spec(tiny_config("gpt_oss"))
    assert spec.config._attn_implementation == SINK_ATTENTION
    assert {la.attn_implementation for la in spec.layers} == {"sinks"}
    assert {la.window for la in spec.layers} == {None, spec.config.sliding_window}
    again = model_spec(spec, "fp32")  # rebuilt from the spec's config, which names SINK_ATTENTION
    assert {la.attn_implementation for la in again.layers} == {"sinks"}
    asked = model_spec(tiny_config("gpt_oss"), attn_implementation=SINK_ATTENTION)
    assert {la.attn_implementation for la in asked.layers} == {"sinks"}
    eager = model_spec(tiny_config("gpt_oss"), attn_implementation="eager")
    assert {la.attn_implementation for la in eager.layers} == {"eager"}
    llama = model_spec(tiny_config("llama"), attn_implementation=SINK_ATTENTION)
    assert {la.attn_implementation for la in llama.layers} == {"sdpa"}  # no sinks: plain sdpa


def test_sinks_count_the_whole_row_with_the_fused_backward() -> None:
    """Under a mask the whole row (windowed layers too); called causal with no mask (full rows'
    full-attention layers, the flash kernel) the causal half, as sdpa."""
    spec = model_spec(tiny_config("gpt_oss"))
    for la in spec.layers:
        full = 2.0 * 1000 * la.attn_heads * (la.attn_qk_dim + la.attn_v_dim)
        assert attention_flops_per_token(la, 1000) == pytest.approx(full)  # windowed ones too
        if la.window is None:
            causal = attention_flops_per_token(la, 1000, causal_only=True)
            assert causal == pytest.approx(full * 1001 / 2000)
    assert ATTENTION_RECOMPUTE_BACKWARD["sinks"] == ATTENTION_RECOMPUTE_BACKWARD["sdpa"]
    la = spec.layers[0]  # keys reach the kernel expanded: no grouped-query gradients to expand
    assert la.attn_kv_heads < la.attn_heads
    per_head = la.attn_qk_dim * 4 + 4
    assert attention_workspace(spec, 2, 96, False) == 2 * 96 * la.attn_heads * per_head


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _gpt_oss_20b(attn_implementation: str | None) -> Any:
    shape = {k: v for k, v in GPT_OSS_20B.items() if k != "model_type"}
    return model_spec(AutoConfig.for_model("gpt_oss", **shape), None, attn_implementation)


def test_the_gpt_oss_20b_layer_holds_no_score_tensor() -> None:
    """Eager keeps at least the probabilities and their gradient, two [B, H, S, S] tensors, at
    its backward peak; the sinks layer none."""
    sinks, eager = _gpt_oss_20b(None), _gpt_oss_20b("eager")
    with _Ops() as ops:
        profile = layer_profile(sinks, ROWS, SEQ, "full")
    layers = {la.attn_implementation for la in sinks.layers}
    assert layers == {FLEX_SINKS} and sinks.layers[0].attn_qk_dim == 64  # + 1, padded to 72
    groups = len(sinks.structure.groups)  # one measured layer each (sliding, full)
    # on meta the sdpa path runs (flex runs on CUDA only; its memory is planned as this path's):
    # sliding layers under their mask: memory-efficient; full layers on full rows: flash
    for kernel in ("efficient", "flash"):
        assert ops.names[f"_scaled_dot_product_{kernel}_attention"] == groups // 2
        assert ops.names[f"_scaled_dot_product_{kernel}_attention_backward"] == groups // 2
    assert profile.causal_only == tuple(t == "full_attention" for t in sinks.config.layer_types)
    la = sinks.layers[0]
    scores = ROWS * la.attn_heads * SEQ * SEQ * sinks.compute_dtype.itemsize  # 2 GiB
    assert profile.largest_bytes < scores
    assert profile.peak_bytes + 2 * scores <= layer_profile(eager, ROWS, SEQ, "full").peak_bytes


def test_the_gpt_oss_20b_row_plans_sinks_below_the_eager_peak() -> None:
    """docs/performance.md run 43's row (tests/planning/test_step_time_32vcpu_host.py pins the
    eager attention it measured) with the default attention: below the compiled eager row's
    GPU peak by the two score tensors its layer holds and the COMPILED_EAGER_SCORES more its
    compiled layer holds."""
    hw = Hardware(optimizer_threads=30).with_overrides(gpu_gib=79.2, host_gib=251)
    plans = {
        attn: cli_row_plan(
            GPT_OSS_20B,
            hw,
            **{"optimizer.state_dtype": "bf16", "memory.gpu_state_blocks": 0, **pin},
        )
        for attn, pin in (("sinks", {}), ("eager", {"model.attn_implementation": "eager"}))
    }
    assert all(plan.engine.compile_layers for plan in plans.values())
    la = _gpt_oss_20b(None).layers[0]
    scores = ROWS * la.attn_heads * SEQ * SEQ * 2
    sinks, eager = (plans[a].estimate for a in ("sinks", "eager"))
    assert sinks.gpu.peak_bytes + (2 + COMPILED_EAGER_SCORES) * scores <= eager.gpu.peak_bytes
    assert sinks.time.step_s < eager.time.step_s


GPT_OSS_12 = {**GPT_OSS_20B, "num_hidden_layers": 12}
RUN_44 = {  # docs/performance.md run 44 (gpt_oss_sinks): allocated, reserved GiB of the card
    "sinks": (25.90, 27.23),
    "eager": (36.99, 40.39),
}


@pytest.mark.parametrize("attn", list(RUN_44))
def test_the_12_layer_rows_of_run_44(attn: str) -> None:
    """GPT-OSS-20B cut to 12 layers, bf16 states (no GPU tier), compiled by auto: the plan's
    peak against the H100's, within 5% allocated and 10% reserved (issue 24's bound). The
    eager row checks COMPILED_EAGER_SCORES, fitted to run 43's 24 layers, on another row."""
    hw = Hardware().with_overrides(gpu_gib=79.2, host_gib=251)
    pin = {} if attn == "sinks" else {"model.attn_implementation": "eager"}
    plan = cli_row_plan(
        GPT_OSS_12, hw, **{"optimizer.state_dtype": "bf16", "memory.gpu_state_blocks": 0, **pin}
    )
    gib = 2**30
    allocated, reserved = RUN_44[attn]
    assert plan.engine.compile_layers and plan.gpu_state_blocks == 0
    assert abs(plan.estimate.gpu.allocated_bytes / gib / allocated - 1) <= 0.05
    assert abs(plan.estimate.gpu.peak_bytes / gib / reserved - 1) <= 0.10


def test_the_whole_gpt_oss_20b_row_of_run_46() -> None:
    """All 24 layers with the sinks default, bf16 states (no GPU tier), compiled by auto, on one
    H100 of the 4-GPU machine (503 GiB host): 29.03 GiB allocated and 31.49 reserved at the peak.
    The plan within 5% allocated and 10% reserved (issue 24's bound)."""
    hw = Hardware().with_overrides(gpu_gib=79.2, host_gib=503)
    plan = cli_row_plan(
        GPT_OSS_20B, hw, **{"optimizer.state_dtype": "bf16", "memory.gpu_state_blocks": 0}
    )
    assert plan.engine.compile_layers and plan.gpu_state_blocks == 0
    assert abs(plan.estimate.gpu.allocated_bytes / 2**30 / 29.03 - 1) <= 0.05
    assert abs(plan.estimate.gpu.peak_bytes / 2**30 / 31.49 - 1) <= 0.10


def test_the_flex_layers_of_run_78() -> None:
    """GPT-OSS-20B cut to 4 layers on an H200 (docs/performance.md run 78, the defaults: GPU tier
    5 of 6, fp32 states): the attention kernels FLEX_RATE_FRACTION was fitted to (0.41 ms
    forward, 1.71 ms recompute + backward a layer and micro-batch) and the layers' GPU time
    (0.194 s forward and 0.615 s recompute + backward a step) within issue 43's 10%."""
    spec = _gpt_oss_20b(None)
    hw = Hardware(gpu_name="NVIDIA H200", gpu_hbm_gbps=4800.0)
    rate = hw.flops_per_s(spec.compute_dtype, spec.hidden_size)
    tokens = ROWS * SEQ
    assert {la.attn_implementation for la in spec.layers} == {FLEX_SINKS}
    attention = [tokens * attention_flops_per_token(la, SEQ) for la in spec.layers[:2]]
    per_layer = sum(attention) / 2  # a sliding-window and a full layer, averaged
    forward = per_layer / (rate * FLEX_RATE_FRACTION[0])
    backward = ATTENTION_RECOMPUTE_BACKWARD[FLEX_SINKS] * per_layer / (rate * FLEX_RATE_FRACTION[1])
    assert forward == pytest.approx(0.41e-3, rel=0.02)
    assert backward == pytest.approx(1.71e-3, rel=0.02)
    shape = {**GPT_OSS_20B, "num_hidden_layers": 4}
    hw = dataclasses.replace(hw, gpu_bytes=int(140.4 * 2**30), host_bytes=125 * 2**30)
    time = cli_row_plan(shape, hw).estimate.time
    assert abs((time.compute_s - time.loss_s) / (0.194 + 0.615) - 1) <= 0.10
