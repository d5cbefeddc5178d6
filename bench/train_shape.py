"""Train a preset-shaped model (random init) with the streaming engine; print step times.

    python bench/train_shape.py --preset qwen2.5-3b --batch 4 --seq 2048 --micro 1 --steps 5
    python bench/train_shape.py --preset llama3.1-8b --batch 1 --seq 131072 --steps 1 \
        --max-grad-norm 1 --old-too --memory.gpu_state_blocks 0
    python bench/train_shape.py --preset llama3.1-8b --batch 1 --seq 524288 --layers 4 \
        --steps 1 --max-grad-norm 1 --attn-bench --memory.gpu_state_blocks 0

The same batch every step, as in bench/peers.py, so the loss visibly falls. The run is built
by megatrain's RunBuilder from a config (the preset as model.config_overrides), so config
overrides after the options apply as in `megatrain train`. Prints a per-step line (loss, step
time, timeline) and one RESULT line: median step time, tokens/s, model TFLOPS (6 x params x
tokens/s, and with attention FLOPs), GPU time per phase (forward, loss, backward), GPU peak,
host RSS, the layer-input plan and MLP tiles used, and the estimate's prediction of each.

`--old-too` then trains the same model and store again with the engine as it was before
long-row support (memory.activation_offload off, checkpoint_every 1, mlp_tiles 1) and prints
its RESULT too (an out-of-memory there is reported, not fatal). `--layers N` keeps N decoder
layers (per-layer numbers extrapolate: step time ~ N x per-layer + loss). `--sdpa` puts a
scaled-dot-product-attention backend first; `--attn-bench` times that kernel alone at the
run's shape (causal, forward + backward) and reports its TFLOPS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

import torch
from common import host_peak_rss_gib, host_rss_gib, log, preset_config, result, sync

from megatrain.batch import Batch
from megatrain.builder import RunBuilder
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.model.loading import parse_config_sets
from megatrain.resources.plan import ResourcePlan
from megatrain.resources.timing import attention_flops_per_token

LLAMA_31_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_scaling={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
)
OLD = {"memory.activation_offload": "off", "memory.checkpoint_every": 1, "memory.mlp_tiles": 1}
SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def main() -> None:
    ap = argparse.ArgumentParser(
        epilog="Arguments after the options are config overrides for the run, e.g. "
        "--optimizer.state_dtype int8 --memory.gpu_state_blocks auto"
    )
    ap.add_argument("--preset", default="qwen2.5-3b", help="bench/peers.py's, or llama3.1-8b")
    ap.add_argument("--batch", type=int, default=4, help="rows per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    ap.add_argument("--num-slots", type=int, default=2)
    ap.add_argument("--max-grad-norm", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--opt-threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers")
    ap.add_argument("--old-too", action="store_true", help="also the pre-long-row engine")
    ap.add_argument("--sdpa", choices=["default", *SDPA], default="default")
    ap.add_argument("--attn-bench", action="store_true", help="time the attention kernel alone")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a preset config key"
    )
    ap.add_argument(
        "--expandable-segments",
        action="store_true",
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (GiB-sized activations of long "
        "rows fragment the caching allocator less)",
    )
    a, overrides = ap.parse_known_args()
    if a.expandable_segments:  # read when CUDA is first used, which is below
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.preset == "llama3.1-8b":
        model_type, preset = "llama", dict(LLAMA_31_8B)
        preset["max_position_embeddings"] = max(131072, a.seq)
    else:
        model_type = "qwen2"
        preset = dict(preset_config(a.preset).to_diff_dict())
        preset = {
            k: v for k, v in preset.items() if k not in ("model_type", "transformers_version")
        }
    if a.layers:
        preset["num_hidden_layers"] = a.layers
    preset |= parse_config_sets(a.set)
    values = model_values(model_type=model_type, config_overrides=preset) | {
        "model.attn_implementation": "sdpa",
        "training.device": device,
        "training.micro_batch_size": a.batch // a.micro,
        "training.gradient_accumulation_steps": a.micro,
        "training.seq_len": a.seq,
        "data.cutoff_len": a.seq,
        "memory.num_slots": a.num_slots,
        "optimizer.max_grad_norm": a.max_grad_norm,
        "optimizer.impl": a.impl,
        "optimizer.threads": a.opt_threads,
        "training.compile_layers": a.compile or None,
    }
    cfg = shorthand_config(None, overrides, values=values)
    if a.old_too and cfg.memory.gpu_state_blocks != 0:
        ap.error("--old-too trains one store twice: add --memory.gpu_state_blocks 0")
    builder = RunBuilder(cfg)  # the same builder as `megatrain train`: store, optimizer, engine
    t0 = time.perf_counter()
    structure = builder.model()
    t_init = time.perf_counter() - t0
    store = builder.store(structure)
    t_store = time.perf_counter() - t0 - t_init
    log(
        f"{structure.describe()}; {store.numel / 1e9:.3f}B params; init {t_init:.1f}s, store "
        f"{t_store:.1f}s; host RSS {host_rss_gib()} GiB"
    )
    vocab = structure.causal_lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = a.batch // a.micro
    micro = []
    for _ in range(a.micro):
        ids = torch.randint(0, vocab, (rows, a.seq), generator=gen)
        micro.append(Batch(ids, ids.clone(), None, None))
    common = dict(preset=a.preset, batch=a.batch, seq=a.seq, micro=a.micro, layers=a.layers)
    common |= dict(num_slots=a.num_slots, max_grad_norm=a.max_grad_norm, sdpa=a.sdpa)
    if a.old_too:
        old = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **_keys(OLD)))
        _run(RunBuilder(old), structure, store, micro, a, common | {"engine": "old"})
    label = {"engine": "new", "overrides": " ".join(overrides)}
    _run(builder, structure, store, micro, a, common | label)
    if a.attn_bench and device == "cuda":
        result(**common, **_attention_bench(structure.causal_lm.config, a.seq, a.sdpa))


def _keys(flat: dict[str, Any]) -> dict[str, Any]:
    return {k.split(".", 1)[1]: v for k, v in flat.items()}


def _run(
    builder: RunBuilder,
    structure: Any,
    store: Any,
    micro: list[Batch],
    a: argparse.Namespace,
    tags: dict[str, Any],
) -> None:
    device = builder.device.type
    plan = builder.plan()
    est = plan.estimate
    log(f"[{tags['engine']}] plan: {plan.boundary_reason}; {est.settings['mlp_tiles']} tiles")
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses, phases = [], [], []
    engine = None
    try:
        engine = builder.engine(structure, store)
        for step in range(a.steps + 1):
            sync()
            t = time.perf_counter()
            with _sdpa(a.sdpa):
                res = engine.train_step(micro, lr=a.lr)
            times.append(time.perf_counter() - t)
            losses.append(res.loss)
            tl = res.timeline
            phases.append((tl.forward_gpu_s, tl.loss_gpu_s, tl.backward_gpu_s))
            log(
                f"step {step} loss {res.loss:.4f} norm {res.grad_norm:.3f} time {times[-1]:.3f}s "
                f"| GPU forward {phases[-1][0]:.2f} loss {phases[-1][1]:.2f} backward "
                f"{phases[-1][2]:.2f} | {tl.summary()}"
            )
    except torch.OutOfMemoryError as e:
        result(**tags, error=f"out of GPU memory: {str(e).splitlines()[0]}")
        return
    finally:
        if engine is not None:
            engine.close()
    runs = _Runs(times, losses, phases, res.timeline.as_dict())
    _report(builder, plan, store.numel, a, tags, runs)


@dataclasses.dataclass
class _Runs:
    times: list[float]
    losses: list[float]
    phases: list[tuple[float, float, float]]  # GPU forward, loss, backward
    timeline: dict[str, float]


def _report(
    builder: RunBuilder,
    plan: ResourcePlan,
    n: int,
    a: argparse.Namespace,
    tags: dict[str, Any],
    runs: _Runs,
) -> None:
    est, times, phases = plan.estimate, runs.times, runs.phases
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    tokens = a.batch * a.seq
    spec = builder.spec
    attn_fwd = sum(attention_flops_per_token(la, a.seq) for la in spec.layers) * tokens
    cuda = builder.device.type == "cuda"
    mid = phases[1:] or phases
    result(
        **tags,
        params_b=round(n / 1e9, 3),
        step_s=round(step_s, 3),
        tokens_per_s=round(tokens / step_s, 1),
        model_tflops=round(6 * n * tokens / step_s / 1e12, 1),
        model_tflops_with_attention=round((6 * n * tokens + 3 * attn_fwd) / step_s / 1e12, 1),
        gpu_forward_s=round(statistics.median(p[0] for p in mid), 3),
        gpu_loss_s=round(statistics.median(p[1] for p in mid), 3),
        gpu_backward_s=round(statistics.median(p[2] for p in mid), 3),
        gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        host_rss_gib=host_rss_gib(),
        host_peak_rss_gib=host_peak_rss_gib(),
        plan=plan.boundary_reason,
        mlp_tiles=est.settings["mlp_tiles"],
        predicted_step_s=round(est.time.step_s, 3),
        predicted_loss_s=round(est.time.loss_s, 3),
        predicted_gpu_peak_gib=round(est.gpu.peak_bytes / 2**30, 2),
        predicted_host_gib=round(est.host.total_bytes / 2**30, 2),
        losses=[round(v, 4) for v in runs.losses],
        timeline=runs.timeline,
    )


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


def _attention_bench(config: Any, seq: int, backend: str) -> dict[str, Any]:
    """One causal sdpa forward + backward at the model's heads and `seq` tokens, bf16."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    q = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    times = {}
    for phase in ("forward", "backward"):
        best = float("inf")
        for _ in range(2):
            sync()
            t = time.perf_counter()
            with _sdpa(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=kv != heads
                )
            if phase == "backward":
                sync()
                t = time.perf_counter()
                out.backward(torch.ones_like(out))
            sync()
            best = min(best, time.perf_counter() - t)
            del out
        times[phase] = best
    fwd_flops = 4 * seq * seq * heads * dim / 2  # causal: half of Q K^T and P V
    return dict(
        attention_kernel=backend,
        attention_forward_s=round(times["forward"], 3),
        attention_backward_s=round(times["backward"], 3),
        attention_forward_tflops=round(fwd_flops / times["forward"] / 1e12, 1),
        attention_backward_tflops=round(2.5 * fwd_flops / times["backward"] / 1e12, 1),
    )


if __name__ == "__main__":
    main()
