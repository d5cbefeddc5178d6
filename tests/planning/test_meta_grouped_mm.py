"""The fp32 MoE layer profile on meta: transformers' grouped-matmul fallback is replaced by a
stand-in with its memory (some transformers releases read the expert offsets on the host in its
backward, which meta tensors cannot do)."""

from __future__ import annotations

import torch

from megatrain.model.tiny import tiny_config
from megatrain.planning import model_spec
from megatrain.planning.activations import _LiveBytes, layer_profile
from megatrain.planning.meta_kernels import GpuKernels, MetaGroupedMM


def test_stand_in_holds_the_fallbacks_bytes() -> None:
    tokens, k, n, experts = 96, 64, 40, 8
    x = torch.empty(tokens, k, device="meta", requires_grad=True)
    w = torch.empty(experts, k, n, device="meta", requires_grad=True)
    with _LiveBytes() as live:
        out = MetaGroupedMM.apply(x, w)
        assert out.shape == (tokens, n) and live.live == 4 * tokens * n
        gx, gw = torch.autograd.grad(out, [x, w], torch.empty_like(out))
    assert gx.shape == x.shape and gw.shape == w.shape
    # output, its gradient, and the gradients of input and weight (what the fallback allocates)
    assert live.peak == 4 * (2 * tokens * n + tokens * k + experts * k * n)


def test_fp32_moe_profile_routes_grouped_matmuls_to_the_stand_in() -> None:
    seen: list[torch.dtype] = []
    route = GpuKernels.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is getattr(torch, "_grouped_mm", None) or func is getattr(
            torch.nn.functional, "grouped_mm", None
        ):
            seen.append(args[0].dtype)
        return route(self, func, types, args, kwargs)

    spec = model_spec(tiny_config("qwen3_moe"), "fp32")
    GpuKernels.__torch_function__ = spy  # type: ignore[method-assign]
    try:
        profile = layer_profile(spec, 2, 64, "full")
    finally:
        GpuKernels.__torch_function__ = route  # type: ignore[method-assign]
    assert seen and set(seen) == {torch.float32}
    # at least what the experts' weight gradients alone hold: gate_up and down, all experts
    cfg = tiny_config("qwen3_moe")
    experts = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert profile.peak_bytes >= 4 * experts
