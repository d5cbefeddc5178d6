"""Memory of an optional kernel package's call, as the package's own autograd Function holds it,
for the layer profile on meta (planning/activations.py).

The profile cannot launch a package's Triton kernels on meta tensors and runs the call's torch
reference in their place (model/kernels.py), whose memory is far above the kernels' (its fp32
[64 x 64] chunk blocks, the recurrent state it saves for every chunk). Where this file models
the call (`MODELS`, by the name of the package function), `FusedCalls.wrap`
(planning/fused.py), which already counts the call's time as the package's kernels, runs the
model instead: tensors of the sizes and dtypes the package's code allocates, made, saved and
freed where its Python code makes, saves and frees them, so the profile's tracker sees the
call's forward transient, what it keeps for the backward, and its backward's peak. A call form
a model does not cover, and every other package call, runs the reference (an upper bound).

flash-linear-attention's `chunk_gated_delta_rule`, read in fla 0.6.0 (gated_delta_rule/chunk.py
ChunkGatedDeltaRuleFunction and its _fwd/_bwd, gated_delta_rule/chunk_fwd.py and wy_fast.py,
common/chunk_delta_h.py and chunk_o.py, modules/norm/l2norm.py, utils/cumsum.py; the dqkwg
backward of common/backends/tilelang, which fla takes on Hopper with Triton 3.4-3.7, allocates
as the Triton one), for the call the HF Gated DeltaNet layers make in training (Qwen3.5,
Qwen3-Next): q, k [B, T, H, K] and v [B, T, HV, V] in the compute dtype, views of the
convolution's output; g [B, T, HV] fp32; beta [B, T, HV]; the query-key l2 norm in the kernel;
no initial or final state, no cu_seqlens; fla's chunk size, 64 (NT = ceil(T / 64) chunks).
Legend: [HV, K] stands for a [B, T, HV, K] tensor in the compute dtype (c bytes), f32 for fp32.
- forward: input_guard's contiguous copies of q, k, v, held until the forward returns; normed
  q, k [H, K] and an f32 rstd [B, T, H] each; the gate's chunk cumsum g' f32 [B, T, HV]; A
  [HV, 64]; w [HV, K], u [HV, V]; the chunk states h [B, NT, HV, K, V] (c) and v_new [HV, V];
  the output o [HV, V]. w, u, h and v_new go when the forward returns.
- kept for the backward: the normed q and k with their rstd, v's copy, g', beta, A.
- backward (chunk_gated_delta_rule_bwd's locals live until it returns): w, u, h, v_new again;
  dv_local [HV, V]; dh like h and dv2 [HV, V], which replaces dv_local; dq, dk, dw [HV, K] and
  dg f32 [K / 64, B, T, HV], then dq and dk summed over each key head's value heads to [H, K]
  and dg over its first dimension; the WY backward's dk2 [HV, K] (summed to [H, K]), dv [HV,
  V], which replaces dv2, dg2 f32 and db like beta; dg's reverse cumsum; then each l2 norm's
  backward, a new dq and dk. Largest: h and dh, 2 x HV x K x V / 64 bytes a token in bf16.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

CHUNK = 64
"""fla's chunk size for the gated delta rule (its default: the HF layers pass none to fla)."""
_DQKWG_BLOCK_K = 64
"""The key block of fla's dqkwg backward (tilelang's; Triton's is 128 on Hopper): one f32 gate
gradient per block, summed after."""


def _new(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _states(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per-chunk recurrent states [B, NT, HV, K, V] in k's dtype (h, dh) for k [B, T, _, K] and
    v [B, T, HV, V]."""
    b, s, _, dim_k = k.shape
    return _new(k, b, math.ceil(s / CHUNK), v.shape[2], dim_k, v.shape[3])


def _per_key_head(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A [B, T, HV, K] gradient summed over the value heads of each of `heads` key heads."""
    b, s, value_heads, dim_k = grad.shape
    return grad if value_heads == heads else _new(grad, b, s, heads, dim_k)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """fla's ChunkGatedDeltaRuleFunction as memory (the module docstring): empty tensors of its
    sizes, made, saved and freed in its order; its output and gradients hold no values."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        l2norm: bool,
    ) -> torch.Tensor:
        guarded = [t.contiguous() for t in (q, k, v, g, beta)]  # input_guard's, held to the end
        q, k, v, g, beta = guarded
        q_rstd = k_rstd = None
        if l2norm:
            q, q_rstd = torch.empty_like(q), _new(q, *q.shape[:-1], dtype=torch.float32)
            k, k_rstd = torch.empty_like(k), _new(k, *k.shape[:-1], dtype=torch.float32)
        b, s, _, dim_k = k.shape
        g = torch.empty_like(g, dtype=torch.float32)  # the chunk cumsum
        a = _new(k, b, s, v.shape[2], CHUNK)
        w, u = _new(k, b, s, v.shape[2], dim_k), torch.empty_like(v)
        h, v_new = _states(k, u), torch.empty_like(u)
        o = torch.empty_like(v_new).to(q.dtype)
        del w, u, h, v_new, guarded
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, a)
        ctx.l2norm = l2norm
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, _, k, _, v, g, beta, _ = ctx.saved_tensors
        dq, dk, dv, db, dg = _backward(q, k, v, g, beta, do.contiguous())
        if ctx.l2norm:  # l2norm_bwd: a gradient like the normed input, one after the other
            dq = torch.empty_like(q)
            dk = torch.empty_like(k)
        return dq, dk, dv, dg, db, None


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """chunk_gated_delta_rule_bwd's buffers, (dq, dk, dv, db, dg) returned."""
    b, s, heads, dim_k = k.shape
    value_heads = v.shape[2]
    w, u = _new(k, b, s, value_heads, dim_k), torch.empty_like(v)  # recompute_w_u
    h, v_new = _states(k, u), torch.empty_like(u)  # the state pass again
    dv = torch.empty_like(do)  # dv_local
    dh, dv = _states(q, do), torch.empty_like(dv)  # dhu: dv2 replaces dv_local
    dq, dk = _new(q, b, s, value_heads, dim_k), _new(k, b, s, value_heads, dim_k)  # dqkwg
    dw = torch.empty_like(w)
    dg = _new(g, math.ceil(dim_k / _DQKWG_BLOCK_K), *g.shape, dtype=torch.float32)
    dq = _per_key_head(dq, heads)
    dk = _per_key_head(dk, heads)
    dg = _new(dg, *g.shape)
    dk2, dv_wy = _new(k, b, s, value_heads, dim_k), torch.empty_like(v)  # prepare_wy_repr_bwd
    dg2, db = torch.empty_like(g), torch.empty_like(beta)
    dk2 = _per_key_head(dk2, heads)
    dv = dv_wy  # replaces dv2 (dk += dk2 and dg += dg2 in place)
    dg = torch.empty_like(dg)  # the reverse chunk cumsum
    del w, u, h, v_new, dh, dw, dk2, dg2, dv_wy
    return dq, dk, dv, db, dg


def chunk_gated_delta_rule(reference: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The HF layer's call with fla's memory, where it is the training form the module
    docstring describes; else `reference(*args, **kwargs)` itself."""
    signature = inspect.signature(reference)
    call = signature.bind(*args, **kwargs)
    named = {**call.arguments.pop("kwargs", {}), **call.arguments}
    if (
        named.get("initial_state") is not None
        or named.get("output_final_state")
        or named.get("cu_seqlens") is not None
    ):
        return reference(*args, **kwargs)
    q, k, v, g, beta = (named[n] for n in list(signature.parameters)[:5])  # as fla's, in order
    l2norm = bool(named.get("use_qk_l2norm_in_kernel", False))
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, l2norm), None


MODELS: dict[str, Callable[..., Any]] = {"chunk_gated_delta_rule": chunk_gated_delta_rule}
"""Package functions whose call memory is modelled, by name (their torch reference's, less the
`torch_` prefix). Each takes the reference, then the call's arguments."""


def run_as_package(reference: Callable[..., Any]) -> Callable[..., Any]:
    """What the profile runs for a package function whose torch reference is `reference`: its
    memory model where `MODELS` has one, else the reference."""
    name = str(getattr(reference, "__name__", "")).removeprefix("torch_")
    model = MODELS.get(name)
    return reference if model is None else functools.partial(model, reference)
