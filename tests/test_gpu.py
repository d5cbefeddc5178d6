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
