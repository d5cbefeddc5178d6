"""flash-linear-attention's chunk_gated_delta_rule as memory (planning/kernel_memory.py) against
the buffers of fla 0.6.0's source, counted here from its allocations (chunk.py, chunk_fwd.py,
wy_fast.py, chunk_delta_h.py, chunk_o.py, l2norm.py, cumsum.py), for a tiny call on meta in the
HF layer's form: q, k, v views of the convolution's output, g fp32, beta bf16, the l2 norm in
the kernel. The shape exercises what changes sizes: a partial last chunk (T = 130: 3 chunks),
3 value heads a key head (the gradients' sums), K = 96 (two 64-wide dqkwg blocks)."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from megatrain.model.kernels import hub_function
from megatrain.planning.activations import _LiveBytes
from megatrain.planning.kernel_memory import chunk_gated_delta_rule, run_as_package

B, T, H, HV, K, V = 2, 130, 2, 6, 96, 80
N, NT, C = B * T, math.ceil(T / 64), 2  # tokens, chunks, bytes of bf16
_MODULE_LEVEL = hub_function(modeling_qwen3_5.torch_chunk_gated_delta_rule)
REFERENCE = getattr(  # transformers' torch code (later releases wrap it: `__wrapped__`)
    _MODULE_LEVEL, "__wrapped__", _MODULE_LEVEL
)


def _inputs(device: str = "meta") -> list[torch.Tensor]:
    """q, k, v as the layer passes them (views of one [B, C, T] tensor), g, beta."""
    conv = torch.randn(B, 2 * H * K + HV * V, T, dtype=torch.bfloat16, device=device)
    conv.requires_grad_(True)
    q, k, v = torch.split(conv.transpose(1, 2), [H * K, H * K, HV * V], dim=-1)
    g = torch.randn(B, T, HV, device=device).requires_grad_(True)
    beta = torch.rand(B, T, HV, dtype=torch.bfloat16, device=device).requires_grad_(True)
    return [q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V), g, beta]


def _fla_bytes() -> tuple[int, int, int]:
    """(forward peak, kept after the forward, backward peak beyond what it starts with) of
    fla's call, beyond its inputs and the output gradient, from fla's allocations."""
    qk, hv_k, hv_v = N * H * K * C, N * HV * K * C, N * HV * V * C
    rstd, gate, beta, a = N * H * 4, N * HV * 4, N * HV * C, N * HV * 64 * C
    states = B * NT * HV * K * V * C  # h, dh
    dg_blocks = math.ceil(K / 64) * gate
    copies = 2 * qk + hv_v  # input_guard's contiguous q, k, v
    kept = 2 * qk + 2 * rstd + hv_v + gate + a  # normed q, k, rstd, v's copy, g', A
    forward = copies + 2 * qk + 2 * rstd + gate + a + hv_k + hv_v + states + hv_v + hv_v
    recomputed = hv_k + hv_v + states + hv_v  # w, u, h, v_new
    moments = [  # chunk_gated_delta_rule_bwd's live buffers at each allocation that can peak
        recomputed + hv_v + states + hv_v,  # dhu: dv_local, dh, dv2
        recomputed + states + hv_v + 3 * hv_k + dg_blocks + qk,  # dqkwg, dq's head sum
        recomputed + states + hv_v + 2 * qk + hv_k + gate + hv_k + hv_v + gate + beta + qk,
    ]
    return forward, kept + hv_v, max(moments)  # kept + the output o


def _tracked(inputs: list[torch.Tensor]) -> tuple[int, int, int, list[torch.Tensor]]:
    """The model's (forward peak, kept, backward peak) under the layer profile's tracker, and
    the inputs' gradients."""
    tracker = _LiveBytes()
    do = torch.empty(B, T, HV, V, dtype=torch.bfloat16, device="meta")
    with torch.enable_grad(), tracker:
        q, k, v, g, beta = inputs
        o, state = chunk_gated_delta_rule(
            REFERENCE, q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True
        )
        assert state is None and o.shape == (B, T, HV, V) and o.dtype == torch.bfloat16
        forward, kept = tracker.peak, tracker.live
        tracker.peak = tracker.live
        grads = list(torch.autograd.grad(o, inputs, do))
        backward = tracker.peak - kept
    return forward, kept, backward, grads


def test_the_model_holds_fla_s_buffers() -> None:
    inputs = _inputs()
    forward, kept, backward, grads = _tracked(inputs)
    assert (forward, kept, backward) == _fla_bytes()
    for x, dx in zip(inputs, grads, strict=True):  # gradients like the inputs, as fla's
        assert (dx.shape, dx.dtype) == (x.shape, x.dtype)


def _run(fn: Any, inputs: list[torch.Tensor], **options: Any) -> Any:
    q, k, v, g, beta = inputs
    return fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **options)


def test_fla_s_buffers_are_far_below_the_torch_reference_s() -> None:
    """The reference's fp32 chunk blocks and per-chunk states: what the profile counted before
    the model (an upper bound)."""
    tracker = _LiveBytes()
    with torch.enable_grad(), tracker:
        out = _run(REFERENCE, _inputs())
        kept = tracker.live  # its output and what its autograd nodes keep
    assert out[0].shape == (B, T, HV, V)
    assert _tracked(_inputs())[1] < kept / 2


def test_a_call_form_the_model_does_not_cover_runs_the_reference() -> None:
    """A final state asked for, or an initial one given (decoding with a cache): the reference
    itself runs, on real tensors too."""
    torch.manual_seed(0)
    inputs = [t.detach() for t in _inputs("cpu")]
    state = torch.zeros(B, HV, K, V)
    for options in (dict(output_final_state=True), dict(initial_state=state)):
        modelled = _run(run_as_package(REFERENCE), inputs, **options)
        reference = _run(REFERENCE, inputs, **options)
        assert torch.equal(modelled[0], reference[0])


def torch_causal_conv1d_fn(x: torch.Tensor) -> torch.Tensor:
    """A package function's reference the file has no model of."""
    return x


def test_only_a_modelled_function_leaves_its_reference() -> None:
    assert run_as_package(REFERENCE) is not REFERENCE
    assert run_as_package(torch_causal_conv1d_fn) is torch_causal_conv1d_fn
