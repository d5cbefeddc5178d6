"""Compact rollout weights on CUDA (skipped without a GPU): fp8 through torch._scaled_mm equals the
dequantized product within the activations' fp8 rounding, and GRPO runs with int8 and fp8
rollouts on the static path with CUDA graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_grpo_cuda import _trainer

from megatrain.model.quant_linear import QuantLinear, dequantize, quantize, scaled_mm_capable

pytestmark = pytest.mark.gpu


def _fp8_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    if not scaled_mm_capable(device):
        pytest.skip("needs fp8 tensor cores (compute capability >= 8.9)")
    return device


def test_scaled_mm_equals_the_dequantized_product() -> None:
    """Each activation is rounded to fp8 per token: off by at most 2^-4 of itself (normal) or
    its row's scale x 2^-10 (subnormal), so each output is off by at most that error times
    |w| summed, plus the bf16 output's rounding (2^-8 relative) and float32 accumulation."""
    device = _fp8_device()
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(256, 512, generator=gen).to(device)
    x = torch.randn(4, 7, 512, generator=gen).to(device, torch.bfloat16)
    q, s = quantize(w, "fp8")
    layer = QuantLinear(q, s, None)
    assert layer.scaled_mm
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 7, 256)
    w_deq = dequantize(q, s, torch.float32)
    xf = x.float()
    reference = xf @ w_deq.T
    row_scale = xf.abs().amax(-1, keepdim=True) / 448
    x_error = torch.maximum(2.0**-4 * xf.abs(), row_scale * 2.0**-10)
    bound = (
        x_error @ w_deq.abs().T + 2.0**-8 * reference.abs() + 2.0**-20 * (xf.abs() @ w_deq.abs().T)
    )
    assert bool(((out.float() - reference).abs() <= bound).all())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_grpo_runs_with_a_compact_rollout_on_graphs(tmp_path: Path, fmt: str) -> None:
    trainer = _trainer(tmp_path, "--training.max_steps", "2", "--grpo.rollout_weights", fmt)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_compact"] for r in rows] == [1, 1]
    for r in rows:
        assert r["time/decode_step_ms"] > 0  # the static path decoded
        assert 0.5 < r["importance_ratio"] < 2.0 and r["loss"] == r["loss"]  # finite
