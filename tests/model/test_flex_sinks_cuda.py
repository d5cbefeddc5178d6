"""Attention sinks on flex attention (model/flex_sinks.py, CUDA only) equal transformers' eager
GPT-OSS attention, as the sdpa path does on the CPU (tests/model/test_sink_attention.py, whose
module and fp32 rounding bounds this reuses; the masks are tests/model/test_flex_sinks.py's):
outputs and the gradients of query, key, value and sinks for causal, sliding-window, padded
(queries with no visible key included) and absent masks, at a length inside one flex block and at
one over several blocks (partial and skipped blocks; both run padded to a power-of-two width),
eager and inside a compiled function with dynamic shapes (the engine's compiled layers). fp32:
flex's kernel and cuBLAS (no TF32 by default) round as fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_flex_sinks import _mask as flex_mask
from test_sink_attention import (
    HEADS,
    KV_HEADS,
    ROWS,
    SINKS,
    _additive,
    _assert_fp32_close,
    _batches,
    _loss_and_grads,
    _module,
)
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import megatrain.model.flex_sinks as flex_sinks
from megatrain.model.loading import load_causal_lm
from megatrain.verify import TOLERANCES
from megatrain.verify.judge import rel_errors

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or flex_sinks.flex_attention is None:
    pytest.skip("needs CUDA and torch's flex attention", allow_module_level=True)


@pytest.fixture(autouse=True)
def _fresh_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's call shapes count against a budget of their own (flex_sinks._SHAPES)."""
    monkeypatch.setattr(flex_sinks, "_SHAPES", set())


def _mask(kind: str, seq: int) -> torch.Tensor | None:
    """test_flex_sinks' mask on the GPU (a 40-token window, 3 rows of left padding); None."""
    return None if kind == "none" else flex_mask(kind, seq, window=40, left=3).cuda()


def _check(call: Any, kind: str, seq: int, head_dim: int) -> None:
    module = _module().cuda()
    torch.manual_seed(1)
    q, k, v = (
        torch.randn(ROWS, h, seq, head_dim, device="cuda", requires_grad=True)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    mask = _mask(kind, seq)
    eager_mask = _additive((_mask("causal", seq) if mask is None else mask).cpu()).cuda()
    ref, _ = eager_attention_forward(module, q, k, v, eager_mask, scaling=module.scaling)
    out = call(module, q, k, v, mask)
    forward = head_dim + 2 * (seq + 1) + 4  # dots, softmax sums, the sink's reweighting
    _assert_fp32_close(out, ref, forward)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).cuda()
    inputs = (q, k, v, module.sinks)
    backward = forward + head_dim + seq + 1 + ROWS * seq * HEADS // KV_HEADS
    for ours, theirs in zip(
        torch.autograd.grad(out, inputs, grad),
        torch.autograd.grad(ref, inputs, grad),
        strict=True,
    ):
        assert torch.isfinite(ours).all()
        _assert_fp32_close(ours, theirs, backward)
    if kind == "padded":  # a query that sees no key attends to the sink alone: output 0
        assert torch.equal(out[1, :3], torch.zeros_like(out[1, :3]))


def _sinks(module: Any, q: Any, k: Any, v: Any, mask: Any) -> torch.Tensor:
    return SINKS(module, q, k, v, mask, scaling=module.scaling, s_aux=module.sinks)[0]


@pytest.mark.parametrize("seq", [24, 300])
@pytest.mark.parametrize("kind", ["causal", "sliding", "padded", "none"])
def test_flex_equals_eager(kind: str, seq: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []

    def spied(*args: Any) -> torch.Tensor | None:
        out = flex_sinks.flex_sink_attention(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr("megatrain.model.sink_attention.flex_sink_attention", spied)
    _check(_sinks, kind, seq, 64)
    assert ran and all(ran), "the sink attention did not run on flex attention on CUDA"


def test_flex_inside_a_compiled_function_with_dynamic_shapes() -> None:
    """As the engine compiles a layer (engine/slots.py: dynamic): the block mask is built in
    the compiled graph; two lengths, one compile."""
    torch._dynamo.reset()
    compiled = torch.compile(_sinks, dynamic=True)
    for seq in (200, 300):
        _check(compiled, "sliding", seq, 64)


def test_decoding_and_odd_head_dims_keep_the_sdpa_path() -> None:
    q = torch.zeros(1, 4, 1, 64, device="cuda")
    assert not flex_sinks.flex_ready(q, None, True, square=False)
    for dims in (16, 72):  # flex's kernel failed at 16 in fp32 (flex_sinks.HEAD_DIMS)
        odd = torch.zeros(1, 4, 8, dims, device="cuda")
        assert not flex_sinks.flex_ready(odd, None, True, True)
    assert flex_sinks.flex_ready(torch.zeros(1, 4, 8, 64, device="cuda"), None, True, True)


@pytest.mark.parametrize("layout", ["padded", "packed", "full"])
def test_the_loaded_model_on_flex_equals_eager(layout: str) -> None:
    """The tiny GPT-OSS at head dim 64 on the GPU, as the loader builds it (sinks on flex):
    loss and gradients equal to the same weights run eager (verify's fp32 tolerances)."""
    models = [
        load_causal_lm(
            None,
            model_type="gpt_oss",
            tiny=True,
            seed=0,
            config_overrides={"head_dim": 64},
            attn_implementation=implementation,
        ).cuda()
        for implementation in (None, "eager")
    ]
    batch = {k: v.cuda() for k, v in _batches()[layout].items()}
    (loss, grads, _), (eager_loss, eager_grads, _) = (_loss_and_grads(m, batch) for m in models)
    tolerance = TOLERANCES["fp32"]
    assert abs(float(loss / eager_loss) - 1) <= tolerance["loss"]
    worst = max(rel_errors(grads, eager_grads).items(), key=lambda kv: kv[1])
    assert worst[1] <= tolerance["grad"], worst
