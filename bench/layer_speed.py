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
`--profile FILE`: also the top CUDA kernels of one forward and one forward + backward
(torch.profiler), per implementation, appended to FILE, and each kernel's summed time by phase
in FILE.<implementation>.kernels.json (bench/step_profile/step_kernels.py sums it by kind).
`--layers N` (N > 1): the first N layers of the preset as its decoder stack runs them
(`model.model` on input embeddings: transformers builds each layer type's mask, a sliding
window's too), each layer compiled alone as the engine compiles it; the RESULT is per layer
(the stack's time / N). A model with attention sinks and no sdpa path in transformers (GPT-OSS)
runs the engine's sink attention (model/sink_attention.py `use_sinks`), as `megatrain train`
does.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch
from common import preset_values, result, sync, timed_s

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
    ap.add_argument("--layers", type=int, default=1, help="> 1: the decoder stack's first N")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    model, cfg = _model(a.preset, a.layers, a.device)
    layers = model.model.layers
    plain = list(layers)  # the layers as built; compiled anew for each experts implementation
    params = sum(active_params(layer, cfg) for layer in plain)
    weights = [w for layer in plain for w in layer.parameters()]
    rows = a.tokens // a.seq
    x = torch.randn(rows, a.seq, cfg.hidden_size, device=a.device, dtype=torch.bfloat16)
    pos = torch.arange(a.seq, device=a.device)[None].expand(rows, -1)
    rope = model.model.rotary_emb(x, pos)

    def call(xi: torch.Tensor) -> torch.Tensor:
        if a.layers > 1:
            return model.model(inputs_embeds=xi, position_ids=pos).last_hidden_state
        out = layers[0](xi, position_embeddings=rope, attention_mask=None, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    def time_layer(experts: str) -> None:
        if experts:
            model.set_experts_implementation(experts)
        for i, layer in enumerate(plain):
            layers[i] = torch.compile(layer) if a.compile else layer

        def fwd() -> None:
            with torch.no_grad():
                call(x)

        def fwd_bwd() -> None:
            xi = x.detach().requires_grad_(True)
            out = call(xi)
            torch.autograd.grad(out, [xi, *weights], torch.ones_like(out))

        for name, fn, flops in (("forward", fwd, 2), ("forward+backward", fwd_bwd, 6)):
            ms = timed_s(fn, a.device, warmup=3) * 1e3 / a.layers
            result(
                bench="layer",
                preset=a.preset,
                tokens=a.tokens,
                compiled=a.compile,
                experts=experts or "default",
                layers=a.layers,
                phase=name,
                ms=round(ms, 2),  # per layer
                active_params=params // a.layers,
                tflops=round(flops * params * a.tokens / (ms * a.layers) / 1e9, 1),
            )
        if a.profile:
            from step_profile.step_kernels import kernel_totals
            from torch.profiler import ProfilerActivity, profile, record_function

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for phase, fn in (("forward", fwd), ("forward_backward", fwd_bwd)):
                    with record_function(f"mt:{phase}"):
                        fn()
                sync()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
            with open(a.profile, "a") as f:
                f.write(f"## {a.preset} experts={experts or 'default'} compiled={a.compile}\n")
                f.write(table + "\n")
            trace = f"{a.profile}.{experts or 'default'}.trace.json"
            prof.export_chrome_trace(trace)
            totals = kernel_totals(json.loads(Path(trace).read_text()))
            Path(trace).with_suffix("").with_suffix(".kernels.json").write_text(json.dumps(totals))

    for experts in a.experts.split(",") if a.experts else [""]:
        time_layer(experts)


def _model(preset: str, num_layers: int, device: str) -> tuple[Any, Any]:
    """The preset's first `num_layers` layers as a bf16 causal LM on `device`, built by
    megatrain's own loader (model/loading.py `load_causal_lm`): the attention `megatrain train`
    runs, the sink attention where transformers has no sdpa path for the model (GPT-OSS)."""
    from megatrain.model.loading import load_causal_lm

    model_type, values = preset_values(preset, num_hidden_layers=num_layers)
    model = load_causal_lm(
        None,
        model_type=model_type,
        config_overrides=values,
        init_device=torch.device(device),
        progress_bar=False,
    )
    # every tensor to the device: run 78 found a norm weight left on the CPU
    return model.to(device, torch.bfloat16), model.config


if __name__ == "__main__":
    main()
