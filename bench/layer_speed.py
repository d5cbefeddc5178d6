"""How fast one decoder layer runs on the GPU: eager vs torch.compile, forward and backward.

    python bench/layer_speed.py --preset qwen2.5-7b --tokens 8192

Times, for one bf16 decoder layer of the preset and one micro-batch (rows x seq), the engine's
per-layer work: a forward without autograd, then a forward with autograd + backward (the
recompute). Reports TFLOP/s against the layer's matmul FLOPs (2 x params x tokens per forward),
which is what the engine's step-time model uses.
"""

from __future__ import annotations

import argparse

import torch
from common import preset_config, result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    cfg = preset_config(a.preset)
    cfg.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda()
    layer = model.model.layers[0]
    params = sum(p.numel() for p in layer.parameters())
    rows = a.tokens // a.seq
    x = torch.randn(rows, a.seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(a.seq, device="cuda")[None].expand(rows, -1)
    rope = model.model.rotary_emb(x, pos)
    run = torch.compile(layer) if a.compile else layer

    def fwd() -> None:
        with torch.no_grad():
            run(x, position_embeddings=rope, attention_mask=None, position_ids=pos)

    def fwd_bwd() -> None:
        xi = x.detach().requires_grad_(True)
        out = run(xi, position_embeddings=rope, attention_mask=None, position_ids=pos)
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
            phase=name,
            ms=round(ms, 2),
            tflops=round(flops * params * a.tokens / ms / 1e9, 1),
        )


if __name__ == "__main__":
    main()
