"""grpo.compile_decode in the plan: which models and devices decode on the static path (and why
not), the compiled decoding step's seconds from their formula, and the recipe recording the
static path's timings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo_command import _reward_file, _run
from test_grpo_plan import GRPO, HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, LC, LP, MODEL, N, _builder

from megatrain.config import load_config
from megatrain.distributed import Placement
from megatrain.planning import Hardware
from megatrain.planning.activations import layer_profile
from megatrain.planning.hardware import GIB
from megatrain.planning.rollout import DECODE_OP_S, SAMPLER_OPS, rollout_estimate
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.plan import decode_mode, format_rollout, grpo_plan, training_config

HW = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)


@pytest.mark.parametrize("mode", ["graphs", "compiled"])
def test_static_decode_step_follows_its_formula(mode: str) -> None:
    spec = _builder(HW).spec
    c, params = 2, spec.total_params
    kw = {"sequences": N, "prompt_tokens": LP, "completion_tokens": LC}
    eager = rollout_estimate(spec, HW, **kw)
    static = rollout_estimate(spec, HW, decode=mode, **kw)
    hbm, rate = HW.gpu_hbm_gbps * 1e9, HW.flops_per_s(torch.bfloat16, HIDDEN)
    ops = sum(f for f, _ in layer_profile(spec, 1, 16, "padded").ops) + SAMPLER_OPS
    kv_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * c
    weights_s = max(params * c / hbm, 2.0 * params * N / rate)
    step = weights_s + N * (LP + LC) * kv_token / hbm + ops * DECODE_OP_S[mode]  # whole cache
    assert static.decode_ops == ops and static.decode == mode
    assert static.decode_token_s == pytest.approx(step, rel=1e-12)
    assert static.capture_s == pytest.approx(2 * eager.decode_token_s, rel=1e-12)
    assert static.rollout_s == pytest.approx(
        eager.weight_copy_s + eager.prefill_s + static.capture_s + LC * step, rel=1e-12
    )
    assert static.gpu_items == eager.gpu_items  # the static cache holds Lp + Lc, as counted
    assert static.decode_token_s < eager.decode_token_s


def test_plan_decodes_compiled_on_cuda_for_dense_full_attention_models() -> None:
    plan = grpo_plan(_builder(HW))
    assert plan.rollout.decode == "compiled" and not plan.rollout.streamed
    assert "torch.compile'd forward, one CUDA graph per token" in plan.decode_reason
    assert "graph capture" in format_rollout(plan)
    graphs = grpo_plan(_builder(HW, "--grpo.compile_decode", "graphs"))
    assert graphs.rollout.decode == "graphs" and "eager kernels" in graphs.decode_reason
    off = grpo_plan(_builder(HW, "--grpo.compile_decode", "false"))
    assert off.rollout.decode == "generate" and "compile_decode: false" in off.decode_reason
    assert plan.rollout.decode_token_s < off.rollout.decode_token_s
    assert grpo_plan(_builder(HW), free_gpu_bytes=0).rollout.decode == "generate"  # streamed
    gemma2 = ["--model.model_type", "gemma2", "--model.tiny", "true", "--model.tokenizer", "demo"]

    def sliding(*extra: str) -> RunBuilder:  # gemma2: every other layer slides
        cfg = training_config(load_config(None, [*gemma2, *GRPO, *extra]))
        return RunBuilder(cfg, hardware=HW, placement=Placement(torch.device("cuda")))

    mode, why = decode_mode(sliding())
    assert mode == "generate" and why.startswith("transformers' generate: sliding-window")
    for setting in ("true", "graphs"):
        with pytest.raises(ValueError, match=rf"compile_decode: {setting}, but .* sliding-window"):
            decode_mode(sliding("--grpo.compile_decode", setting))
    flash = _builder(HW, "--model.attn_implementation", "flash_attention_2")
    assert "attention implementation 'flash_attention_2'" in decode_mode(flash)[1]


def test_compile_decode_on_the_cpu_follows_the_setting() -> None:
    def on_cpu(*extra: str) -> str:
        cfg = load_config(None, [*MODEL, *extra])
        return decode_mode(RunBuilder(cfg, placement=Placement(torch.device("cpu"))))[0]

    assert on_cpu() == "generate"  # auto: generate on the CPU
    assert on_cpu("--grpo.compile_decode", "true") == "compiled"  # no graphs on the CPU
    assert on_cpu("--grpo.compile_decode", "graphs") == "graphs"
    with pytest.raises(ValueError, match=r"grpo\.compile_decode='always' must be one of"):
        load_config(None, [*MODEL, "--grpo.compile_decode", "always"])


def test_grpo_run_on_the_static_path_records_its_timings(tmp_path: Path) -> None:
    reward = _reward_file(tmp_path)
    steps = ["--training.max_steps", "2"]
    rows = _run(tmp_path / "static", reward, "--grpo.compile_decode", "graphs", *steps)
    eager = _run(tmp_path / "eager", reward, *steps)  # auto on the CPU: generate
    for row in rows:
        assert row["time/decode_step_ms"] > 0 and row["time/prefill_capture_s"] > 0
        assert 1 <= row["completion_length"] <= row["completion_length_max"] <= 5
    assert all("time/decode_step_ms" not in row for row in eager)
