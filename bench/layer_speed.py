"""How fast one decoder layer runs on the GPU: eager vs torch.compile, forward and backward.

    python bench/layer_speed.py --preset qwen2.5-7b --tokens 8192
    python bench/layer_speed.py --preset qwen3-30b-a3b --experts grouped_mm,batched_mm,eager

Times, for one bf16 decoder layer of the preset and one micro-batch (rows x seq), the engine's
per-layer work: a forward without autograd, then a forward with autograd + backward (the
recompute). Reports TFLOP/s against the layer's matmul FLOPs (2 x active params x tokens per
forward; an MoE layer's routed experts count top_k / num_experts of their parameters), which is
what the engine's step-time model uses.

`--experts`: an MoE preset's experts under each of transformers' experts implementations
(`set_experts_implementation`: grouped_mm, batched_mm, eager), one RESULT line each.
`--profile FILE`: also the top CUDA kernels of one forward + backward (torch.profiler), per
implementation, appended to FILE.
"""

from __future__ import annotations

import argparse
import re

import torch
from common import preset_config, result

_ROUTED = re.compile(r"(^|\.)experts\.")


def active_params(layer: torch.nn.Module, cfg: object) -> int:
    """The layer's parameters a token uses: routed experts count top_k / num_experts."""
    total = sum(p.numel() for p in layer.parameters())
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return total
    routed = sum(
        p.numel()
        for n, p in layer.named_parameters()
        if _ROUTED.search(n) and "shared" not in n and p.shape[0] == experts
    )
    return total - routed + routed * top_k // experts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--experts", default="", help="comma-separated experts implementations")
    ap.add_argument("--profile", default="", help="append the top kernels to this file")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    cfg = preset_config(a.preset)
    cfg.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda()
    layer = model.model.layers[0]
    params = active_params(layer, cfg)
    rows = a.tokens // a.seq
    x = torch.randn(rows, a.seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(a.seq, device="cuda")[None].expand(rows, -1)
    rope = model.model.rotary_emb(x, pos)

    def time_layer(experts: str) -> None:
        if experts:
            model.set_experts_implementation(experts)
        run = torch.compile(layer) if a.compile else layer

        def fwd() -> None:
            with torch.no_grad():
                run(x, position_embeddings=rope, attention_mask=None, position_ids=pos)

        def fwd_bwd() -> None:
            xi = x.detach().requires_grad_(True)
            out = run(xi, position_embeddings=rope, attention_mask=None, position_ids=pos)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, [xi, *layer.parameters()], torch.ones_like(out))

        for name, fn, flops in (("forward", fwd, 2), ("forward+backward", fwd_bwd, 6)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 10
            result(
                bench="layer",
                preset=a.preset,
                tokens=a.tokens,
                compiled=a.compile,
                experts=experts or "default",
                phase=name,
                ms=round(ms, 2),
                active_params=params,
                tflops=round(flops * params * a.tokens / ms / 1e9, 1),
            )
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fwd_bwd()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
            with open(a.profile, "a") as f:
                f.write(f"## {a.preset} experts={experts or 'default'} compiled={a.compile}\n")
                f.write(table + "\n")

    for experts in a.experts.split(",") if a.experts else [""]:
        time_layer(experts)


if __name__ == "__main__":
    main()
