"""Train a preset-shaped model (random init) with the streaming engine; print step times.

    python bench/train_shape.py --preset qwen2.5-3b --batch 4 --seq 2048 --micro 1 --steps 5

The same batch every step, as in bench/peers.py, so the loss visibly falls. The run is built
by megatrain's RunBuilder from a config (the preset as model.config_overrides), so config
overrides after the options apply as in `megatrain train`. Prints a
per-step line (loss, step time, timeline) and one RESULT line: median step time, tokens/s,
model TFLOPS (6 x params x tokens/s), GPU peak, host RSS.

Under torchrun (`python -m torch.distributed.run --nproc-per-node N bench/train_shape.py ...`)
every rank trains on its own random rows (--batch rows per rank, so the job's step has
N x batch rows), the store sharded as in `megatrain train`; rank 0 prints one RESULT with the
job's tokens/s, tokens/s per GPU, the largest GPU peak of any rank, the node's host RSS (the
ranks' sum: one node) and what the estimate predicted for this node (pred_rss_gib) and rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from common import host_peak_rss_gib, host_rss_gib, log, preset_values, result, sync

from megatrain.batch import Batch
from megatrain.builder import RunBuilder
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.resources import probe


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
    ap.add_argument("--steps", type=int, default=5)
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
    a, overrides = ap.parse_known_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_type, preset = preset_values(
        a.preset, **({"num_hidden_layers": a.layers} if a.layers else {})
    )
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
    hardware = probe() if a.probe else None
    builder = RunBuilder(cfg, hardware=hardware)  # as `megatrain train`: plan, store, engine
    p = builder.placement  # under torchrun: this rank's
    plan = builder.plan()  # the run's own plan: its GPU tier, and the prediction printed below
    plan.require_fit()  # per node and rank, before anything large is allocated
    pred = plan.estimate
    log(f"plan: {plan.tier_reason or ''} predicted step {pred.time.step_s:.3f}s")
    t0 = time.perf_counter()
    structure, store = builder.model_and_store()  # sharded over the ranks
    t_load = time.perf_counter() - t0
    engine = builder.engine(structure, store)
    opt = engine.worker.optimizer
    n_params = builder.spec.total_params
    log(
        f"rank {p.rank}/{p.world_size}: {structure.describe()}; {n_params / 1e9:.3f}B params; "
        f"init + store {t_load:.1f}s; optimizer {opt.impl} x {opt.num_threads}; host RSS "
        f"{host_rss_gib()} GiB"
    )
    vocab = structure.causal_lm.config.vocab_size
    gen = torch.Generator().manual_seed(p.rank)  # every rank its own rows
    rows = a.batch // a.micro
    micro = []
    for _ in range(a.micro):
        ids = torch.randint(0, vocab, (rows, a.seq), generator=gen)
        micro.append(Batch(ids, ids.clone(), None, None))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, timelines = [], [], []
    for step in range(a.steps + 1):
        sync()
        t = time.perf_counter()
        res = engine.train_step(micro, lr=a.lr)
        times.append(time.perf_counter() - t)
        losses.append(res.loss)
        timelines.append(res.timeline)
        log(
            f"step {step} loss {res.loss:.4f} norm {res.grad_norm:.3f} time {times[-1]:.3f}s "
            f"| {res.timeline.summary()}"
        )
    engine.close()
    step_s = statistics.median(times[1:])
    tokens = a.batch * a.seq * p.world_size
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    host = [host_rss_gib(), host_peak_rss_gib()]
    if p.world_size > 1:  # the largest GPU peak of any rank; host RSS summed over the node
        peak_t = torch.tensor([gpu_peak], device=builder.device)
        host_t = torch.tensor(host, dtype=torch.float64, device=builder.device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(host_t)
        gpu_peak, host = float(peak_t), [round(float(v), 2) for v in host_t]
        dist.destroy_process_group()
        if p.rank != 0:
            return
    idle = [1 - r.compute_s / r.step_s for r in timelines[1:] if r.step_s > 0]
    result(
        system="megatrain",
        preset=a.preset,
        params_b=round(n_params / 1e9, 3),
        batch=a.batch,
        seq=a.seq,
        micro=a.micro,
        num_slots=a.num_slots,
        max_grad_norm=a.max_grad_norm,
        optimizer=opt.impl,
        opt_threads=opt.num_threads,
        overrides=" ".join(overrides),
        compiled=a.compile,
        gpus=p.world_size,
        load_s=round(t_load, 1),
        step_s=round(step_s, 3),
        tokens_per_s=round(tokens / step_s, 1),
        tokens_per_s_per_gpu=round(tokens / step_s / p.world_size, 1),
        model_tflops=round(6 * n_params * tokens / step_s / 1e12, 1),
        gpu_peak_gib=round(gpu_peak, 2) if device == "cuda" else None,
        host_rss_gib=host[0],  # the node's (every rank's) at the end
        host_peak_rss_gib=host[1],
        gpu_idle_frac=round(statistics.median(idle), 3) if idle else None,
        gpu_state_blocks=plan.gpu_state_blocks,
        state_dtype=cfg.optimizer.state_dtype,
        pred_step_s=round(pred.time.step_s, 3),
        pred_gpu_gib=round(pred.gpu.peak_bytes / 2**30, 2),
        pred_rss_gib=round(pred.host.total_bytes / 2**30, 2),
        pred_bound=pred.time.bound,
        pred_optimizer_s=round(pred.time.optimizer_s, 3),
        hw_optimizer_gparams_s=round(builder.hardware.optimizer_gparams_s, 2),
        hardware_measured=list(builder.hardware.measured),
        losses=[round(v, 4) for v in losses],
        timeline=res.timeline.as_dict(),
    )


if __name__ == "__main__":
    main()
