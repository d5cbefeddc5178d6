"""A tiled layer whose norms' outputs are not kept (engine/norm_fusion.py) equals the plain
layer: one decoder layer of tiny models in float64, its output and the gradients of its input
and of every parameter, against the same layer run whole by plain PyTorch autograd.

Tolerance: every compared element is a sum over at most W terms (W the widest of the tokens S
and the layer's dimensions), and HF's norms compute in fp32 even for float64 inputs; tiling
regroups those sums and reruns the fp32 norms on tiles (whose reductions may round otherwise),
which moves an element by at most ~W fp32 roundings of the largest term: 4 x W x eps32 x the
reference's magnitude. A wrong tile, a missing norm chain or a dropped gradient is off by a
relative O(1).
Whole training steps through the engine with these paths: tests/engine/test_long_context.py
and tests/engine/test_attention_heads.py (verify against plain PyTorch).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from megatrain.engine import norm_fusion
from megatrain.engine.tiling import TilePolicy, tiled_per_token
from megatrain.model.capture import LayerCallCapture
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover

_EPS32 = torch.finfo(torch.float32).eps
SEQ = 24
TILES = 5  # uneven: tiles of 5 tokens and a last one of 4


def _layer_case(model_type: str) -> tuple[Any, list[Any], torch.Tensor, torch.Tensor, int]:
    torch.manual_seed(0)
    model = load_causal_lm(None, model_type=model_type, tiny=True).to(torch.float64).eval()
    structure = discover(model)
    cfg = model.config.get_text_config()
    embeds = torch.randn(2, SEQ, cfg.hidden_size, dtype=torch.float64)
    captured = LayerCallCapture(structure).capture(embeds, None, None)
    x = torch.randn(2, SEQ, cfg.hidden_size, dtype=torch.float64)
    grad = torch.randn_like(x)
    widest = max(SEQ, cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or 0)
    return structure, captured.calls, x, grad, widest


def _run(layer: Any, call: Any, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    out = call.run(layer, x)
    got = torch.autograd.grad(out, [x, *params], grad, allow_unused=True)
    return [out.detach(), *(g if g is not None else torch.zeros(()) for g in got)]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text", "gemma3_text", "qwen3"])
def test_tiled_layers_equal_plain_autograd(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    structure, calls, x, grad, widest = _layer_case(model_type)
    fused: list[int] = []
    apply = norm_fusion._NormThenFn.apply

    def counted(*args: Any) -> torch.Tensor:
        fused.append(1)
        out: torch.Tensor = apply(*args)
        return out

    monkeypatch.setattr(norm_fusion._NormThenFn, "apply", counted)
    tol_scale = 4 * widest * _EPS32
    for i, layer in enumerate(structure.layers):
        want = _run(layer, calls[i], x, grad)
        before = len(fused)
        with tiled_per_token([layer], TilePolicy(TILES)):
            got = _run(layer, calls[i], x, grad)
        assert len(fused) > before, f"layer {i}: no norm output was left to its input"
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            tol = tol_scale * w.abs().max().item()
            assert (g - w).abs().max().item() <= tol, f"layer {i}, tensor {k}"


def test_the_norm_output_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a tiled llama layer's forward under autograd, the outputs of both norms are gone
    (their consumers kept the norms' inputs), while the graph still differentiates."""
    structure, calls, x, grad, _ = _layer_case("llama")
    layer = structure.layers[0]
    made: list[weakref.ref[torch.Tensor]] = []
    record = norm_fusion.record

    def recording(out: torch.Tensor, *args: Any) -> None:
        made.append(weakref.ref(out))
        record(out, *args)

    monkeypatch.setattr(norm_fusion, "record", recording)
    monkeypatch.setattr("megatrain.engine.tiling.record", recording)
    with tiled_per_token([layer], TilePolicy(TILES)):
        x = x.detach().requires_grad_(True)
        out = calls[0].run(layer, x)
        gc.collect()
        assert len(made) == 2 and all(ref() is None for ref in made)
        (gx,) = torch.autograd.grad(out, [x], grad)
    assert gx.abs().sum().item() > 0
