"""Eager attention in the step time: the spec records which attention the layers run, eager
layers count FLOPs over the whole [S, S] score matrix, and the meta profile tells the scores'
elementwise traffic apart, which a compiled MoE layer does not take as routing. GPT-OSS runs
eager only when asked (`attn_implementation="eager"`): its default is sdpa with sinks
(tests/planning/test_sink_attention_plan.py)."""

from __future__ import annotations

import pytest

from megatrain.model.tiny import tiny_config
from megatrain.planning import Hardware, model_spec
from megatrain.planning.activations import layer_profile
from megatrain.planning.layer_time import (
    COMPILED_ROUTING_FRACTION,
    COMPILED_TRAFFIC_FRACTION,
    HBM_FRACTION,
    attention_flops_per_token,
    layer_seconds,
)

SEQ = 96  # no tiny dimension (hidden 64, head 16) equals it


def test_the_spec_records_the_attention_the_layers_run() -> None:
    gpt_oss = model_spec(tiny_config("gpt_oss"), attn_implementation="eager")
    assert {la.attn_implementation for la in gpt_oss.layers} == {"eager"}
    assert {la.attn_implementation for la in model_spec(tiny_config("gpt_oss")).layers} == {
        "sinks"  # no sdpa path in transformers: model/sink_attention.py's
    }
    llama = tiny_config("llama")
    assert {la.attn_implementation for la in model_spec(llama).layers} == {"sdpa"}
    eager = model_spec(tiny_config("llama"), attn_implementation="eager")
    assert {la.attn_implementation for la in eager.layers} == {"eager"}


def test_eager_attention_counts_the_whole_square() -> None:
    """No causal half, no window saving: every layer attends over the whole row."""
    spec = model_spec(tiny_config("gemma3_text"), attn_implementation="eager")
    windowed = [la for la in spec.layers if la.window is not None]
    assert windowed and len(windowed) < spec.num_layers
    for la in spec.layers:
        full = 2.0 * 1000 * la.attn_heads * (la.attn_qk_dim + la.attn_v_dim)
        assert attention_flops_per_token(la, 1000) == pytest.approx(full)
    sdpa = model_spec(tiny_config("gemma3_text"))
    assert all(
        attention_flops_per_token(la, 1000) < attention_flops_per_token(eager_la, 1000) / 1.9
        for la, eager_la in zip(sdpa.layers, spec.layers, strict=True)
    )


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_the_profile_tells_the_score_traffic_apart(model_type: str) -> None:
    """Eager: its [S, S] ops are most of a layer's traffic at a long enough row; sdpa's fused
    kernels move none of it."""
    rows = 2
    eager = layer_profile(
        model_spec(tiny_config(model_type), attn_implementation="eager"), rows, SEQ, "full"
    )
    if model_type == "llama":
        sdpa = layer_profile(model_spec(tiny_config("llama")), rows, SEQ, "full")
        assert all(s == (0, 0) for s in sdpa.score_traffic)
    heads = model_spec(tiny_config(model_type)).layers[0].attn_heads
    scores = rows * heads * SEQ * SEQ * 2  # one bf16 pass over the scores
    for (fwd, bwd), (sf, sb) in zip(eager.traffic, eager.score_traffic, strict=True):
        assert 3 * scores < sf < fwd and 6 * scores < sb < bwd


def test_a_compiled_moe_layer_takes_its_score_traffic_as_a_compiled_layer() -> None:
    spec = model_spec(tiny_config("gpt_oss"), attn_implementation="eager")
    hw, n = Hardware(), spec.num_layers
    flops, traffic, scores = [1e9] * n, [(10**9, 3 * 10**9)] * n, [(6 * 10**8, 2 * 10**9)] * n
    fwd, bwd = layer_seconds(spec, hw, flops, flops, traffic, 1, True, (), scores)
    routing_fwd, routing_bwd = layer_seconds(spec, hw, flops, flops, traffic, 1, True)
    hbm = hw.gpu_hbm_gbps * 1e9 * HBM_FRACTION
    share = (COMPILED_TRAFFIC_FRACTION - COMPILED_ROUTING_FRACTION) / hbm
    assert fwd[0] - routing_fwd[0] == pytest.approx(6e8 * share)
    assert bwd[0] - routing_bwd[0] == pytest.approx(2e9 * share)
    eager_fwd, _ = layer_seconds(spec, hw, flops, flops, traffic, 1, False, (), scores)
    assert eager_fwd == layer_seconds(spec, hw, flops, flops, traffic, 1, False)[0]
