"""GPU-only checks (skipped without CUDA): the engine on a real device, streams and all."""

from __future__ import annotations

import pytest

from megatrain.verify import run_verify, verify_config, within

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_text"])
def test_bf16_on_cuda_within_pytorch_bf16_drift(model_type: str) -> None:
    reports = run_verify(
        verify_config(model_type=model_type, tiny=True, device="cuda", dtype="bf16")
    )
    assert within(reports), [(r.excess, r.worst) for r in reports]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_next", "gpt_oss"])
def test_fp32_on_cuda_matches_pytorch(model_type: str) -> None:
    reports = run_verify(
        verify_config(
            model_type=model_type, tiny=True, device="cuda", packed=model_type == "gemma3_text"
        )
    )
    assert within(reports), [(r.excess, r.worst) for r in reports]


def test_compiled_layers_match_pytorch_on_cuda() -> None:
    cfg = verify_config(
        None,
        ["--training.compile_layers", "true"],
        model_type="qwen3",
        tiny=True,
        device="cuda",
        dtype="bf16",
    )
    assert cfg.training.compile_layers
    reports = run_verify(cfg)
    assert within(reports), [(r.excess, r.worst) for r in reports]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_seed_oss_with_dropout_config_on_cuda(dtype: str) -> None:
    # Seed-OSS enables attention and residual dropout; verify compares with both turned off
    # (tests/engine/test_engine_dropout.py proves the engine's masks on CUDA).
    reports = run_verify(
        verify_config(model_type="seed_oss", tiny=True, device="cuda", dtype=dtype)
    )
    assert reports[0].random_off == {"attention_dropout": 0.1, "residual_dropout": 0.1}
    assert within(reports), [(r.excess, r.worst) for r in reports]
