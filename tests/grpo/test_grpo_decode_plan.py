"""grpo.compile_decode in the plan: which models and devices decode on the static path (and why
not), the compiled decoding step's seconds from their formula, and the recipe recording the
static path's timings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo_command import _reward_file, _run
from test_grpo_plan import GRPO, HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, LC, LP, MODEL, N, _builder

from megatrain.builder import Placement, RunBuilder
from megatrain.config import load_config
from megatrain.grpo.plan import decode_compiled, format_rollout, grpo_plan
from megatrain.resources import Hardware
from megatrain.resources.activations import layer_profile
from megatrain.resources.hardware import GIB
from megatrain.resources.rollout import GRAPHED_OP_S, SAMPLER_OPS, rollout_estimate

HW = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)


def test_compiled_decode_step_follows_its_formula() -> None:
    spec = _builder(HW).spec
    c, params = 2, spec.total_params
    kw = {"sequences": N, "prompt_tokens": LP, "completion_tokens": LC}
    eager = rollout_estimate(spec, HW, **kw)
    compiled = rollout_estimate(spec, HW, compiled=True, **kw)
    hbm, rate = HW.gpu_hbm_gbps * 1e9, HW.flops_per_s(torch.bfloat16, HIDDEN)
    ops = sum(f for f, _ in layer_profile(spec, 1, 16, "padded").ops) + SAMPLER_OPS
    kv_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * c
    weights_s = max(params * c / hbm, 2.0 * params * N / rate)
    step = weights_s + N * (LP + LC) * kv_token / hbm + ops * GRAPHED_OP_S  # the whole cache
    assert compiled.decode_token_s == pytest.approx(step, rel=1e-12)
    assert compiled.capture_s == pytest.approx(2 * eager.decode_token_s, rel=1e-12)
    assert compiled.rollout_s == pytest.approx(
        eager.weight_copy_s + eager.prefill_s + compiled.capture_s + LC * step, rel=1e-12
    )
    assert compiled.gpu_items == eager.gpu_items  # the static cache holds Lp + Lc, as counted
    assert compiled.decode_token_s < eager.decode_token_s


def test_plan_decodes_compiled_on_cuda_for_dense_full_attention_models() -> None:
    plan = grpo_plan(_builder(HW))
    assert plan.rollout.compiled and not plan.rollout.streamed
    assert "CUDA graphs" in plan.decode_reason and "graph capture" in format_rollout(plan)
    off = grpo_plan(_builder(HW, "--grpo.compile_decode", "false"))
    assert not off.rollout.compiled and off.decode_reason == "grpo.compile_decode: false"
    assert plan.rollout.decode_token_s < off.rollout.decode_token_s
    assert not grpo_plan(_builder(HW), free_gpu_bytes=0).rollout.compiled  # streamed: never
    gemma2 = ["--model.model_type", "gemma2", "--model.tiny", "true", "--model.tokenizer", "demo"]

    def sliding(*extra: str) -> RunBuilder:  # gemma2: every other layer slides
        cfg = load_config(None, [*gemma2, *GRPO, *extra])
        return RunBuilder(cfg, hardware=HW, placement=Placement(torch.device("cuda")))

    compiled, why = decode_compiled(sliding())
    assert not compiled and why.startswith("transformers' generate: sliding-window")
    with pytest.raises(ValueError, match=r"grpo\.compile_decode: true, but .* sliding-window"):
        decode_compiled(sliding("--grpo.compile_decode", "true"))
    flash = _builder(HW, "--model.attn_implementation", "flash_attention_2")
    assert "attention implementation 'flash_attention_2'" in decode_compiled(flash)[1]


def test_compile_decode_on_the_cpu_follows_the_setting() -> None:
    def on_cpu(*extra: str) -> bool:
        cfg = load_config(None, [*MODEL, *extra])
        return decode_compiled(RunBuilder(cfg, placement=Placement(torch.device("cpu"))))[0]

    assert not on_cpu()  # auto: generate on the CPU
    assert on_cpu("--grpo.compile_decode", "true")  # the same steps, no graphs
    with pytest.raises(ValueError, match=r"grpo\.compile_decode='always' must be one of"):
        load_config(None, [*MODEL, "--grpo.compile_decode", "always"])


def test_grpo_run_on_the_static_path_records_its_timings(tmp_path: Path) -> None:
    reward = _reward_file(tmp_path)
    steps = ["--training.max_steps", "2"]
    rows = _run(tmp_path / "static", reward, "--grpo.compile_decode", "true", *steps)
    eager = _run(tmp_path / "eager", reward, *steps)  # auto on the CPU: generate
    for row in rows:
        assert row["time/decode_step_ms"] > 0 and row["time/prefill_capture_s"] > 0
        assert 1 <= row["completion_length"] <= row["completion_length_max"] <= 5
    assert all("time/decode_step_ms" not in row for row in eager)
