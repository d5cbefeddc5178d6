"""Causal attention alone at a preset's heads: torch's default sdpa order against each backend
put first, forward and backward, bf16, over row lengths.

    python bench/attention_kernels.py --preset llama3.1-8b --seq 8192,32768,131072,524288 \
        --sdpa default,flash,cudnn

`default` is what `megatrain train` runs (torch's own order); the others put one backend first.
One RESULT line per row length and backend: time, TFLOPS (causal FLOPs; backward counted as
2.5 x forward) and the GPU memory the backward adds, for one call over all heads (the engine's
layer below the long-row threshold); `--modes whole,split` also in the engine's long-row head
groups (engine/attention_heads.py).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import types
from typing import Any

import torch
from common import log, preset_values, result, sync

from megatrain.engine.attention_heads import SplitHeads, head_calls

SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.1-8b")
    ap.add_argument("--seq", default="8192,32768,131072")
    ap.add_argument("--sdpa", default="default,flash,cudnn", help=f"default and of {list(SDPA)}")
    ap.add_argument("--reps", type=int, default=2, help="best of; 1 above 131072 tokens")
    ap.add_argument("--modes", default="whole", help="whole (one call), split (head groups)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    backends, modes = a.sdpa.split(","), tuple(a.modes.split(","))
    unknown = [b for b in backends if b != "default" and b not in SDPA]
    if unknown:
        ap.error(f"--sdpa {unknown}: choose from default, {', '.join(SDPA)}")
    _, values = preset_values(a.preset)
    config = types.SimpleNamespace(**values)
    for seq in [int(s) for s in a.seq.split(",")]:
        for backend in backends:
            reps = a.reps if seq <= 131072 else 1
            try:
                r = attention_bench(config, seq, backend, modes=modes, reps=reps)
            except torch.OutOfMemoryError as e:
                r = dict(attention_kernel=backend, error=str(e).splitlines()[0])
            log(f"{seq} tokens, {backend}: {r}")
            result(preset=a.preset, seq=seq, gpu=torch.cuda.get_device_name(), **r)
            torch.cuda.empty_cache()


class _sdpa:
    """sdpa backend priority for the block (torch.nn.attention.sdpa_kernel), or nothing."""

    def __init__(self, name: str) -> None:
        self.ctx: Any = None
        if name != "default":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            first = getattr(SDPBackend, SDPA[name])
            rest = [
                b
                for b in (
                    SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH,
                )
                if b != first
            ]
            self.ctx = sdpa_kernel([first, *rest], set_priority=True)

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def attention_bench(
    config: Any, seq: int, backend: str, modes: tuple[str, ...] = ("whole", "split"), reps: int = 2
) -> dict[str, Any]:
    """One causal sdpa forward + backward at the model's heads and `seq` tokens, bf16: one
    call over all heads ("whole") and the engine's long-row head groups ("split",
    engine/attention_heads.py); time (the best of `reps`), TFLOPS and the backward's GPU peak
    of each."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    # as HF's projections leave them: [1, S, heads, dim] memory seen as [1, heads, S, dim]
    q, k, v = (
        torch.randn(1, seq, n, dim, device="cuda", dtype=torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_(True)
        for n in (heads, kv, kv)
    )
    fwd_flops = 4 * seq * seq * heads * dim / 2  # causal: half of Q K^T and P V
    report: dict[str, Any] = dict(
        attention_kernel=backend, attention_head_calls=head_calls(heads, kv, seq)
    )
    for mode in modes:
        times, peak = {}, 0.0
        for phase in ("forward", "backward"):
            best = float("inf")
            for _ in range(reps):
                sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t = time.perf_counter()
                with _sdpa(backend), SplitHeads() if mode == "split" else contextlib.nullcontext():
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=kv != heads
                    )
                if phase == "backward":
                    sync()
                    t = time.perf_counter()
                    out.backward(torch.ones_like(out))
                sync()  # sync point: the kernels' time
                best = min(best, time.perf_counter() - t)
                peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
                del out
                q.grad = k.grad = v.grad = None
            times[phase] = best
        report |= {
            f"attention_{mode}_forward_s": round(times["forward"], 3),
            f"attention_{mode}_backward_s": round(times["backward"], 3),
            f"attention_{mode}_forward_tflops": round(fwd_flops / times["forward"] / 1e12, 1),
            f"attention_{mode}_backward_tflops": round(
                2.5 * fwd_flops / times["backward"] / 1e12, 1
            ),
            f"attention_{mode}_peak_gib": round(peak, 2),
        }
    return report


if __name__ == "__main__":
    main()
