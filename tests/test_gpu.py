"""GPU-only checks (skipped without CUDA): the engine on a real device, streams and all."""

from __future__ import annotations

import pytest

from megatrain.verify import VerifyConfig, run_verify, within

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_text"])
def test_bf16_on_cuda_within_pytorch_bf16_drift(model_type: str) -> None:
    reports = run_verify(
        VerifyConfig(model_type=model_type, tiny=True, device="cuda", compute_dtype="bfloat16")
    )
    assert within(reports), [(r.excess, r.worst) for r in reports]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_next", "gpt_oss"])
def test_fp32_on_cuda_matches_pytorch(model_type: str) -> None:
    reports = run_verify(
        VerifyConfig(
            model_type=model_type, tiny=True, device="cuda", packed=model_type == "gemma3_text"
        )
    )
    assert within(reports), [(r.excess, r.worst) for r in reports]


def test_compiled_layers_match_pytorch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain.engine import engine

    original = engine.StreamingEngine.__init__

    def compiled(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["compile_layers"] = True
        original(self, *args, **kwargs)

    monkeypatch.setattr(engine.StreamingEngine, "__init__", compiled)
    reports = run_verify(
        VerifyConfig(model_type="qwen3", tiny=True, device="cuda", compute_dtype="bfloat16")
    )
    assert within(reports), [(r.excess, r.worst) for r in reports]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seed_oss_with_dropout_config_on_cuda(dtype: str) -> None:
    # Seed-OSS enables attention and residual dropout; verify compares with both turned off
    # (tests/test_engine_dropout.py proves the engine's masks on CUDA).
    reports = run_verify(
        VerifyConfig(model_type="seed_oss", tiny=True, device="cuda", compute_dtype=dtype)
    )
    assert reports[0].random_off == {"attention_dropout": 0.1, "residual_dropout": 0.1}
    assert within(reports), [(r.excess, r.worst) for r in reports]
