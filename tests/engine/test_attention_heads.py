"""Attention over head groups (engine/attention_heads.py) equals one whole call.

The split is checked two ways: the function against `F.scaled_dot_product_attention` on the
same float64 inputs (causal with grouped-query heads, a mask shared by the heads, a mask per
head), and whole training steps through the engine against plain PyTorch (megatrain.verify,
fp32, 3 steps) for a dense, a hybrid linear-attention, a sliding-window and an MoE model, with
the split forced at tiny sizes (`HEAD_TOKENS` = 1: one call per key-value head). The hybrid runs
packed rows, one input kept every 2 layers, as in tests/engine/test_long_context.py: with full
rows its linear attention's A_log gradient is the most sensitive tensor (Adam's first updates
amplify fp32 reorderings), 0.57 of verify's fp32 allowance with tiles alone and 1.09-1.14 once
the norms' consumers also re-run per tile (engine/norm_fusion.py), while every layer's float64
parity holds (tests/engine/test_norm_fusion.py).

Tolerance of the float64 comparison: every output and gradient element is the same kernel's
arithmetic over the same S keys, only launched per head group; a reordering of its sums could
move it by at most ~S roundings of float64 relative to the largest term, so 8 x S x eps64
times the reference's magnitude bounds it (a wrong head or key-value group is off by O(1)).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatrain.engine import attention_heads
from megatrain.engine.attention_heads import SplitHeads, head_calls
from megatrain.verify import run_verify, verify_config, within

_EPS64 = torch.finfo(torch.float64).eps


def _tol(ref: torch.Tensor, seq: int) -> float:
    return 8 * seq * _EPS64 * max(1.0, ref.abs().max().item())


def _compare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> None:
    seq = q.shape[2]
    grad = torch.randn(q.shape[:3] + v.shape[3:], dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, **options)
    ref_grads = torch.autograd.grad(ref, [q, k, v], grad)
    with SplitHeads():
        out = F.scaled_dot_product_attention(q, k, v, **options)
    assert type(out.grad_fn).__name__ == "_HeadGroupsBackward"  # the split ran
    grads = torch.autograd.grad(out, [q, k, v], grad)
    assert (out - ref).abs().max().item() <= _tol(ref, seq)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.shape == want.shape, name
        assert (got - want).abs().max().item() <= _tol(want, seq), name


def _inputs(heads: int, kv_heads: int, seq: int = 37, dim: int = 16) -> list[torch.Tensor]:
    # the query as HF's projections leave it: [B, S, H, E] memory seen as [B, H, S, E]
    q = torch.randn(2, seq, heads, dim, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, kv_heads, seq, dim, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, dim, dtype=torch.float64)
    return [t.requires_grad_(True) for t in (q, k, v)]


@pytest.fixture
def split_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_heads, "HEAD_TOKENS", 1)


@pytest.mark.usefixtures("split_every_call")
def test_grouped_query_causal() -> None:
    torch.manual_seed(0)
    _compare(*_inputs(8, 2), is_causal=True, enable_gqa=True)


@pytest.mark.usefixtures("split_every_call")
def test_masks_shared_and_per_head() -> None:
    torch.manual_seed(1)
    q, k, v = _inputs(4, 4)
    seq = q.shape[2]
    shared = torch.rand(2, 1, seq, seq) > 0.3
    shared |= torch.eye(seq, dtype=torch.bool)  # every query sees a key
    _compare(q, k, v, attn_mask=shared)
    per_head = torch.randn(2, 4, seq, seq, dtype=torch.float64)
    _compare(q, k, v, attn_mask=per_head, scale=0.3)


def test_whole_where_a_split_cannot_help() -> None:
    q, k, v = _inputs(8, 2)
    with SplitHeads():  # short: one call covers all heads
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with torch.no_grad():  # the forward pass: no backward workspace to bound
            attention_heads.HEAD_TOKENS = 1
            try:
                assert F.scaled_dot_product_attention(q, k, v, enable_gqa=True).grad_fn is None
            finally:
                attention_heads.HEAD_TOKENS = 1 << 21
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"


def test_head_calls() -> None:
    # Llama-3.1-8B: 32 query / 8 key-value heads; a call covers at most 2^21 head x positions
    assert head_calls(32, 8, 524288) == 8
    assert head_calls(32, 8, 131072) == 2
    assert head_calls(32, 8, 65536) == 1
    assert head_calls(32, 8, 1 << 22) == 8  # never more than one key-value group per call
    assert head_calls(28, 4, 300000) == 4  # 5 wanted: the next divisor of 4 that is >= 4
    assert head_calls(16, 16, 524288) == 4


@pytest.mark.usefixtures("split_every_call")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text", "gemma3_text", "qwen3_moe"])
def test_training_steps_equal_plain_pytorch(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    apply = attention_heads._HeadGroups.apply

    def counted(n: int, *args: Any) -> torch.Tensor:
        calls.append(n)
        out: torch.Tensor = apply(n, *args)
        return out

    monkeypatch.setattr(attention_heads._HeadGroups, "apply", counted)
    tiles = ["--memory.mlp_tiles", "3", "--memory.activation_offload", "on"]
    hybrid = model_type == "qwen3_5_text"
    if hybrid:
        tiles += ["--memory.checkpoint_every", "2"]
    cfg = verify_config(None, tiles, model_type=model_type, tiny=True, packed=hybrid)
    reports = run_verify(cfg, steps=3)
    detail = "\n".join(f"step {r.step}: excess {r.excess:.3f} at {r.worst}" for r in reports)
    assert within(reports), detail
    assert all(r.loss_rel < 1e-5 for r in reports)
    assert calls and all(n > 1 for n in calls)  # every layer backward split its attention
