"""Train a preset-shaped model (random init) with the streaming engine; print step times.

    python bench/train_shape.py --preset qwen2.5-3b --batch 4 --seq 2048 --micro 1 --steps 5
    python bench/train_shape.py --preset llama3.1-8b --batch 1 --seq 131072 --steps 1 \
        --max-grad-norm 1 --old-too --memory.gpu_state_blocks 0
    python bench/train_shape.py --preset llama3.1-8b --batch 1 --seq 524288 --layers 4 \
        --steps 1 --max-grad-norm 1 --attn-bench --memory.gpu_state_blocks 0

The same batch every step, as in bench/peers.py, so the loss visibly falls. The run is built
by megatrain's RunBuilder from a config (the preset as model.config_overrides), so config
overrides after the options apply as in `megatrain train`. Prints a per-step line (loss, step
time, GPU time per phase, timeline) and one RESULT line: median step time, tokens/s, model
TFLOPS (6 x params x tokens/s, and with attention FLOPs), GPU time per phase (forward, loss,
backward), GPU peak, host RSS, the layer-input plan and tiles used, and the estimate's
prediction beside them (pred_*).

`--old-too` first trains the same model and store with the engine as it was before long-row
support (memory.activation_offload off, checkpoint_every 1, mlp_tiles 1, torch's default sdpa
backend order) and prints its RESULT too (out of GPU memory there is reported, not fatal).
`--layers N` keeps N decoder layers (per-layer numbers extrapolate: step ~ N x per-layer time
+ loss). `--sdpa` puts one
scaled-dot-product-attention backend first; `--attn-bench` times that kernel alone at the
run's shape (causal, forward and backward), in one call and in the engine's head groups, and
reports its TFLOPS and the GPU memory each backward adds.

Under torchrun (`python -m torch.distributed.run --nproc-per-node N bench/train_shape.py ...`)
every rank trains on its own random rows (--batch rows per rank, so the job's step has
N x batch rows), the store sharded as in `megatrain train`; rank 0 prints one RESULT with the
job's tokens/s, tokens/s per GPU, the largest GPU peak of any rank, the node's host RSS (the
ranks' sum: one node) and what the estimate predicted for this node (pred_rss_gib) and rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from common import host_peak_rss_gib, host_rss_gib, log, preset_values, result, sync

from megatrain.allocator import configure_allocator
from megatrain.batch import Batch
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.distributed import placement_here
from megatrain.engine.attention_heads import SplitHeads, head_calls
from megatrain.model.loading import parse_config_sets
from megatrain.planning import probe
from megatrain.planning.timing import attention_flops_per_token
from megatrain.recipes.builder import RunBuilder
from megatrain.threads import optimizer_threads

OLD = {"activation_offload": "off", "checkpoint_every": 1, "mlp_tiles": 1}  # memory.*
SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def main() -> None:
    ap = argparse.ArgumentParser(
        epilog="Arguments after the options are config overrides for the run, e.g. "
        "--optimizer.state_dtype int8 --memory.gpu_state_blocks auto"
    )
    ap.add_argument("--preset", default="qwen2.5-3b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (preset's: None)")
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
    ap.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine's rates (megatrain estimate --probe) for the printed prediction",
    )
    ap.add_argument("--old-too", action="store_true", help="also the pre-long-row engine")
    ap.add_argument("--sdpa", choices=["default", *SDPA], default="default")
    ap.add_argument("--attn-bench", action="store_true", help="time the attention kernel alone")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="preset key")
    a, overrides = ap.parse_known_args()
    configure_allocator()  # as the megatrain command does, before CUDA is first used (below)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = ({"num_hidden_layers": a.layers} if a.layers else {}) | parse_config_sets(a.set)
    model_type, preset = preset_values(a.preset, **extra)
    values = model_values(model_type=model_type, config_overrides=preset) | {
        "model.attn_implementation": "sdpa",
        "training.device": device,
        # the rows below are plain causal rows (no padding mask): the plan's "full" layout
        "data.stage": "pt",
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
    placement = placement_here(cfg.training.device)  # under torchrun: this rank's GPU, first
    hardware = None
    if a.probe:  # on this rank's GPU (probing before the placement put every rank on GPU 0)
        threads = cfg.optimizer.threads or optimizer_threads(placement.local_world_size)
        hardware = probe(optimizer_threads=threads, state_dtype=cfg.optimizer.state_dtype)
    if hardware is not None and placement.world_size > 1:
        # every rank probed at once with its share of the node's cores; the estimate takes the
        # node's CPU AdamW rate (and splits it over the node's ranks): the sum over one node
        rate = torch.tensor([hardware.optimizer_gparams_s], device=placement.device)
        dist.all_reduce(rate)
        node = float(rate) * placement.local_world_size / placement.world_size
        hardware = dataclasses.replace(hardware, optimizer_gparams_s=node)
    # as `megatrain train`: plan, store, engine
    builder = RunBuilder(cfg, hardware=hardware, placement=placement)
    p = builder.placement  # under torchrun: this rank's
    if p.world_size > 1:
        builder.plan().require_fit()  # per node and rank, before anything large is allocated
    elif builder.plan().problems:  # one process: tried anyway, out of GPU memory is reported
        log(f"plan does not fit: {'; '.join(builder.plan().problems)}")
    t0 = time.perf_counter()
    structure, store = builder.model_and_store()  # sharded over the ranks
    t_load = time.perf_counter() - t0
    log(
        f"rank {p.rank}/{p.world_size}: {structure.describe()}; "
        f"{builder.spec.total_params / 1e9:.3f}B params; init + store {t_load:.1f}s; host RSS "
        f"{host_rss_gib()} GiB"
    )
    vocab = structure.causal_lm.config.vocab_size
    gen = torch.Generator().manual_seed(p.rank)  # every rank its own rows
    rows = a.batch // a.micro
    micro = []
    for _ in range(a.micro):
        ids = torch.randint(0, vocab, (rows, a.seq), generator=gen)
        micro.append(Batch(ids, ids.clone(), None, None))
    tags = dict(system="megatrain", preset=a.preset, batch=a.batch, seq=a.seq, micro=a.micro)
    tags |= dict(layers=a.layers, num_slots=a.num_slots, max_grad_norm=a.max_grad_norm)
    tags |= dict(sdpa=a.sdpa, compiled=a.compile, overrides=" ".join(overrides))
    tags |= dict(gpus=p.world_size, load_s=round(t_load, 1))
    if a.old_too:
        old = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **OLD))
        before = tags | {"engine": "old", "sdpa": "default"}  # the engine as it was, all of it
        _run(RunBuilder(old, hardware=hardware), structure, store, micro, a, before)
    _run(builder, structure, store, micro, a, tags | {"engine": "new"})
    if a.attn_bench and device == "cuda" and p.rank == 0:
        result(**tags, **attention_bench(structure.causal_lm.config, a.seq, a.sdpa))
    if p.world_size > 1:
        dist.destroy_process_group()


def _run(
    builder: RunBuilder,
    structure: Any,
    store: Any,
    micro: list[Batch],
    a: argparse.Namespace,
    tags: dict[str, Any],
) -> None:
    plan = builder.plan()  # the run's own plan: tier, layer inputs, tiles; the prediction
    pred = plan.estimate
    log(
        f"[{tags['engine']}] plan: {plan.tier_reason or ''}; layer inputs: "
        f"{plan.boundary_reason}; {pred.settings['mlp_tiles']} tiles; predicted step "
        f"{pred.time.step_s:.3f}s"
    )
    cuda = builder.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses, timelines = [], [], []
    engine = None
    try:
        engine = builder.engine(structure, store)
        for step in range(a.steps + 1):
            sync()
            t = time.perf_counter()
            with _sdpa(tags["sdpa"]):
                res = engine.train_step(micro, lr=a.lr)
            times.append(time.perf_counter() - t)
            losses.append(res.loss)
            tl = res.timeline
            timelines.append(tl)
            log(
                f"step {step} loss {res.loss:.4f} norm {res.grad_norm:.3f} time {times[-1]:.3f}s "
                f"| GPU forward {tl.forward_gpu_s:.2f} loss {tl.loss_gpu_s:.2f} backward "
                f"{tl.backward_gpu_s:.2f} | {tl.summary()}"
            )
    except torch.OutOfMemoryError as e:
        result(**tags, error=f"out of GPU memory: {str(e).splitlines()[0]}")
        if builder.placement.world_size > 1:
            raise  # torchrun stops the other ranks (they would wait in a collective)
        return
    finally:
        if engine is not None:
            engine.close()
    timed = timelines[1:] or timelines
    step_s = statistics.median(times[1:] or times)
    p, n = builder.placement, builder.spec.total_params
    tokens = a.batch * a.seq * p.world_size
    attn_fwd = sum(attention_flops_per_token(la, a.seq) for la in builder.spec.layers) * tokens
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    host = [host_rss_gib(), host_peak_rss_gib()]
    if p.world_size > 1:  # the largest GPU peak of any rank; host RSS summed over the node
        peak_t = torch.tensor([gpu_peak], device=builder.device)
        host_t = torch.tensor(host, dtype=torch.float64, device=builder.device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(host_t)
        gpu_peak, host = float(peak_t), [round(float(v), 2) for v in host_t]
        if p.rank != 0:
            return
    idle = [1 - r.compute_s / r.step_s for r in timed if r.step_s > 0]
    opt = engine.worker.optimizer
    result(
        **tags,
        params_b=round(n / 1e9, 3),
        optimizer=opt.impl,
        opt_threads=opt.num_threads,
        step_s=round(step_s, 3),
        tokens_per_s=round(tokens / step_s, 1),
        tokens_per_s_per_gpu=round(tokens / step_s / p.world_size, 1),
        model_tflops=round(6 * n * tokens / step_s / 1e12, 1),
        model_tflops_with_attention=round((6 * n * tokens + 3 * attn_fwd) / step_s / 1e12, 1),
        gpu_forward_s=round(statistics.median(t.forward_gpu_s for t in timed), 3),
        gpu_loss_s=round(statistics.median(t.loss_gpu_s for t in timed), 3),
        gpu_backward_s=round(statistics.median(t.backward_gpu_s for t in timed), 3),
        gpu_peak_gib=round(gpu_peak, 2) if cuda else None,
        host_rss_gib=host[0],  # the node's (every rank's) at the end
        host_peak_rss_gib=host[1],
        gpu_idle_frac=round(statistics.median(idle), 3) if idle else None,
        gpu_state_blocks=len(engine.tier),  # under ranks: the count every rank agreed on
        state_dtype=builder.cfg.optimizer.state_dtype,
        layer_inputs=plan.boundary_reason,
        mlp_tiles=pred.settings["mlp_tiles"],
        pred_step_s=round(pred.time.step_s, 3),
        pred_loss_s=round(pred.time.loss_s, 3),
        pred_gpu_gib=round(pred.gpu.peak_bytes / 2**30, 2),
        pred_gpu_phase=pred.gpu.peak_phase,
        pred_gpu_items_gib={k: round(v / 2**30, 2) for k, v in pred.gpu.items.items()},
        pred_rss_gib=round(pred.host.total_bytes / 2**30, 2),
        pred_bound=pred.time.bound,
        pred_optimizer_s=round(pred.time.optimizer_s, 3),
        hw_optimizer_gparams_s=round(builder.hardware.optimizer_gparams_s, 2),
        hardware_measured=list(builder.hardware.measured),
        losses=[round(v, 4) for v in losses],
        timeline=timelines[-1].as_dict(),
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
