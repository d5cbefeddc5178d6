"""Compact rollout weights (model/quant_linear.py): each element's round-trip error within the
format's bound, the layer's product equal to the dequantized weight's, the byte count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatrain.model import quant_linear
from megatrain.model.quant_linear import (
    QuantLinear,
    compact_weight_bytes,
    dequantize,
    quantize,
    quantized_params,
)

F32_EPS = 2.0**-24  # unit roundoff of float32: each of w / s and q x s rounds once


def _weights() -> torch.Tensor:
    """Rows of very different scales, a row of zeros, a row with one large outlier and values
    small enough to fall among fp8's subnormals after scaling."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=gen) * torch.tensor([1.0, 1e-3, 50.0, 0.0, 1.0, 1.0])[:, None]
    w[4, 7] = 400.0  # the outlier sets row 4's scale: its other values land near zero
    w[5, :8] = torch.tensor([3e-3, -2e-3, 1e-4, 5e-5, -7e-6, 1.0, 2.0, -3.0])  # subnormals
    return w


def test_int8_round_trip_is_within_half_a_step() -> None:
    """|w - q s| <= s / 2 (round to nearest), plus the two float32 roundings of w / s and q s,
    each at most F32_EPS of a value of at most 127.5 s."""
    w = _weights()
    q, s = quantize(w, "int8")
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert int(q.abs().max()) == 127 and s[3] == 1.0 and not q[3].any()  # zero row: exact
    error = (w - dequantize(q, s, torch.float32)).abs()
    bound = s[:, None] * (0.5 + 2 * F32_EPS * 127.5)
    assert bool((error <= bound).all())
    assert float((error / bound).max()) > 0.9  # the bound is reached: it is the right one


def test_fp8_round_trip_is_within_half_an_ulp() -> None:
    """e4m3 keeps 3 mantissa bits: a normal value (|w / s| >= 2^-6) rounds by at most half an
    ulp, 2^-4 of itself; a subnormal one by at most half their spacing 2^-9, s x 2^-10. Plus
    the float32 roundings of w / s (its max is 448)."""
    w = _weights()
    q, s = quantize(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and float(q.float().abs().max()) == 448.0
    error = (w - dequantize(q, s, torch.float32)).abs()
    scaled = (w / s[:, None]).abs()
    normal = scaled >= 2.0**-6
    assert bool(normal.any()) and bool((~normal & (w != 0)).any())  # both kinds are tested
    slack = 2 * F32_EPS * 448 * s[:, None]
    bound = torch.where(normal, 2.0**-4 * w.abs(), s[:, None] * 2.0**-10) + slack
    assert bool((error <= bound).all())
    assert float((error / bound).max()) > 0.5


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quant_linear_multiplies_by_the_dequantized_weight(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer is x @ (q s)^T + b, in chunks of output channels: each output is the same dot
    product of length 64 either way (float32 reassociation at most 64 x F32_EPS of sum |x w|)."""
    gen = torch.Generator().manual_seed(1)
    w, b = _weights(), torch.randn(6, generator=gen)
    x = torch.randn(3, 5, 64, generator=gen)
    q, s = quantize(w, fmt)
    layer = QuantLinear(q, s, b)
    expected = x @ dequantize(q, s, torch.float32).T + b
    scale = (x.abs() @ dequantize(q, s, torch.float32).abs().T) * 64 * F32_EPS + 1e-30
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK_BYTES", 2 * 64 * 4)  # 2 channels a chunk
    for out in (layer(x), QuantLinear(q, s, None)(x) + b):
        assert out.shape == (3, 5, 6)
        assert bool(((out - expected).abs() <= scale + F32_EPS * expected.abs()).all())
    assert not layer.scaled_mm  # the CPU dequantizes


def test_compact_bytes_count_one_byte_per_linear_weight() -> None:
    """Two linear layers (one with a bias) and a norm: 1 B per linear weight, a float32 scale
    per output channel, everything else (bias, norm) in the compute dtype."""
    block = nn.ModuleDict(
        {"a": nn.Linear(8, 6, bias=True), "b": nn.Linear(6, 4, bias=False), "n": nn.LayerNorm(8)}
    )
    assert quantized_params(block) == 8 * 6 + 6 * 4
    expected = (8 * 6 + 6 * 4) + 4 * (6 + 4) + 2 * (6 + 8 + 8)
    assert compact_weight_bytes(block, 2) == expected
