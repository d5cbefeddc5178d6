"""What a recipe prints and logs: the plan it runs, and the metrics record of one step.

`step_record` is the record every recipe logs per optimizer step (a recipe adds its own keys);
`memory_record` the host and GPU memory the step used. Neither makes a sync point.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

from megatrain.engine.engine import StepResult
from megatrain.planning.plan import ResourcePlan


def report_plan(plan: ResourcePlan, gpu: bool) -> None:
    if plan.batch_reason:
        print(
            f"micro_batch_size auto: {plan.batch_reason}; gradient accumulation {plan.grad_accum}",
            flush=True,
        )
    if plan.tier_reason and plan.gpu_state_blocks:
        print(f"memory.gpu_state_blocks auto: {plan.tier_reason}", flush=True)
    if plan.tiles_reason:
        print(f"memory.mlp_tiles auto: {plan.tiles_reason}", flush=True)
    if plan.share_reason and plan.engine.gpu_update_blocks:
        print(f"optimizer.gpu_update_blocks auto: {plan.share_reason}", flush=True)
    est = plan.estimate
    for line in est.advice:
        print(f"note: {line}", flush=True)
    print(
        f"resources: host {est.host.total_bytes / 2**30:.1f} GiB"
        + (
            f", GPU peak {est.gpu.peak_bytes / 2**30:.1f} GiB, step {est.time.step_s:.2f} s"
            if gpu
            else ""
        )
        + " (predicted)"
        + (f", bound by {est.time.bound} (GPU busy {est.time.gpu_busy:.0%})" if gpu else ""),
        flush=True,
    )


def step_record(
    result: StepResult, lr: float, step_s: float, device: torch.device | None = None
) -> dict[str, Any]:
    """The metrics record of one optimizer step (what MetricsLogger.log_step takes), with the
    memory the step used (`memory_record`) when `device` is given."""
    record: dict[str, Any] = {
        "loss": result.loss,
        "ce_loss": result.ce_loss,
        "grad_norm": result.grad_norm,
        "clip_coef": result.clip_coef,
        "lr": lr,
        "tokens": result.tokens,
        "target_tokens": result.target_tokens,
        "step_s": round(step_s, 4),
    }
    if result.aux_loss is not None:
        record["aux_loss"] = result.aux_loss
    record.update({f"time/{k}": v for k, v in result.timeline.as_dict().items()})
    if device is not None:
        record.update(memory_record(device))
    return record


def memory_record(device: torch.device) -> dict[str, float]:
    """This process's host RSS now and, on CUDA, the most GPU memory the allocator held
    (`gpu_peak_gib`, reserved: what the card must have) and handed out (`gpu_alloc_peak_gib`)
    since the previous record; the peaks then start again. No sync point (host counters)."""
    record = {"host_rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2)}
    if device.type == "cuda":
        record["gpu_peak_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        record["gpu_alloc_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats(device)
    return record
