"""A run's resource plan: batch choice, estimate and fit check, all from one set of inputs.

    shape = builder.shape()     # RunShape: seq_len, num_slots, layout, clipping, ... of the run
    plan = plan_resources(spec, shape, hardware=hw, micro_batch_size="auto", grad_accum=1,
                          tokens_per_step=65536)
    plan.require_fit()          # ValueError naming what does not fit and what to change

Invariant: the automatic micro-batch is chosen against exactly the estimate that the fit check
then judges (same shape, same loss chunk, same pinning), so "auto" never picks a batch the check
refuses for a reason it did not see. The builder (megatrain.builder) derives the shape from the
run config once; `megatrain estimate` and `megatrain train` both read the plan from there.

The GPU tier of optimizer states (engine/tier.py) is chosen after the batch: the run's
activations come first, and "auto" (`memory.gpu_state_blocks`) gives the tier the largest
number of blocks (layers from the first, then embedding, then head) whose predicted GPU peak
still fits with `gpu_margin_gib` free; on the CPU "auto" is 0. A given count is clamped to the
model's blocks, like `num_slots`.

Several ranks (`RunShape.ranks`): the estimate is per rank on the GPU and per node on the host,
so the fit check refuses a node that cannot hold its ranks' shards, before loading; no GPU tier.
Later plans (activation offload for long rows) extend `RunShape` and
`ResourcePlan`, not their callers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatrain.resources.batch_size import pick_micro_batch
from megatrain.resources.estimate import Estimate, estimate
from megatrain.resources.fit import gpu_problem, host_problem
from megatrain.resources.hardware import GIB, Hardware, gib
from megatrain.resources.ranks import ONE_PROCESS, Ranks
from megatrain.resources.spec import ModelSpec

LAYOUTS = ("padded", "packed", "full")


@dataclass(frozen=True)
class RunShape:
    """What the estimate needs besides the model and the batch: the run's fixed settings."""

    seq_len: int
    num_slots: int
    layout: str  # "padded" rows (masks), "packed" samples, or "full" rows without mask
    clipping: bool
    loss_chunk_tokens: int | None
    pin_memory: bool
    check_gpu: bool  # a CUDA run: the GPU peak must fit too
    state_dtype: str  # AdamW m and v on the host: "fp32", "bf16" or "int8" (host memory)
    gpu_state_blocks: int | str = 0  # GPU-tier blocks, or "auto" (resolved by the plan)
    compiled: bool = False  # decoder layers torch.compile'd (training.compile_layers)
    ranks: Ranks = ONE_PROCESS  # processes of the job (torchrun); the batch is per rank

    def estimate_kwargs(self) -> dict[str, Any]:
        assert self.layout in LAYOUTS, self.layout
        return dict(
            seq_len=self.seq_len,
            num_slots=self.num_slots,
            padded=self.layout == "padded",
            packed=self.layout == "packed",
            clipping=self.clipping,
            loss_chunk_tokens=self.loss_chunk_tokens,
            pin_memory=self.pin_memory,
            compiled=self.compiled,
        )


@dataclass(frozen=True)
class ResourcePlan:
    """The batch a run uses and what it is predicted to need; `problems` empty when it fits."""

    micro_batch_size: int
    grad_accum: int
    estimate: Estimate
    batch_reason: str | None  # why "auto" chose this micro-batch (None: it was given)
    problems: tuple[str, ...]
    gpu_state_blocks: int = 0  # blocks (layers, embedding, head) whose states live on the GPU
    tier_reason: str | None = None  # why "auto" chose that many (None: it was given)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def tokens_per_step(self) -> int:
        return int(self.estimate.settings["tokens_per_step"])

    def require_fit(self) -> None:
        """Raise ValueError with the numbers and what to change when the run does not fit."""
        if self.problems:
            raise ValueError("this run does not fit: " + "; ".join(self.problems))


def plan_resources(
    spec: ModelSpec,
    shape: RunShape,
    *,
    hardware: Hardware,
    micro_batch_size: int | str,
    grad_accum: int = 1,
    tokens_per_step: int | None = None,
    gpu_margin_gib: float = 2.0,
    host_margin_gib: float = 4.0,
    gpu_reserve_bytes: int = 0,
) -> ResourcePlan:
    """Resolve the batch ("auto" or given) and predict the run.

    `gpu_reserve_bytes`: GPU memory another phase of the run needs beside the engine's
    persistent buffers (GRPO's resident rollout); the automatic GPU tier leaves it free.

    `tokens_per_step` (optional) fixes the step's tokens: with "auto" the accumulation follows
    the chosen micro-batch; with a given micro-batch it must divide the step's rows.
    """
    reason = None
    if micro_batch_size == "auto":
        target: dict[str, Any] = (
            {"tokens_per_step": tokens_per_step}
            if tokens_per_step is not None
            else {"grad_accum": grad_accum}
        )
        kwargs = shape.estimate_kwargs()
        micro_batch_size, grad_accum, reason = pick_micro_batch(
            spec, hardware=hardware, gpu_margin_gib=gpu_margin_gib, **target, **kwargs
        )
    elif tokens_per_step is not None:
        grad_accum = _grad_accum_for(tokens_per_step, int(micro_batch_size), shape.seq_len)
    assert isinstance(micro_batch_size, int)

    def predict(tier: int) -> Estimate:
        return estimate(
            spec,
            micro_batch_size=micro_batch_size,
            grad_accum=grad_accum,
            hardware=hardware,
            gpu_state_blocks=tier,
            state_dtype=shape.state_dtype,
            ranks=shape.ranks,
            **shape.estimate_kwargs(),
        )

    tier_reason = None
    if shape.gpu_state_blocks == "auto" and shape.state_dtype != "fp32":
        tier, tier_reason = 0, f"GPU tier: none (state_dtype {shape.state_dtype}: fp32 only)"
    elif shape.gpu_state_blocks == "auto":
        tier, tier_reason = _pick_tier(
            predict,
            spec.num_layers + 2,
            shape.check_gpu,
            hardware,
            gpu_margin_gib,
            gpu_reserve_bytes,
        )
    else:
        tier = min(int(shape.gpu_state_blocks), spec.num_layers + 2)
    est = predict(tier)
    problems = [host_problem(est, hardware, host_margin_gib)]
    if shape.check_gpu:
        problems.append(gpu_problem(est, hardware, gpu_margin_gib))
    return ResourcePlan(
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        estimate=est,
        batch_reason=reason,
        problems=tuple(p for p in problems if p),
        gpu_state_blocks=tier,
        tier_reason=tier_reason,
    )


def _pick_tier(
    predict: Callable[[int], Estimate],
    num_blocks: int,
    on_gpu: bool,
    hardware: Hardware,
    gpu_margin_gib: float,
    reserve: int = 0,
) -> tuple[int, str]:
    """The most blocks (tier order) whose GPU-tier states fit beside the run, and beside
    `reserve` bytes next to the persistent buffers, and why.

    The predicted peak grows with the count (each block adds 8-18 B/param and frees at most
    its share of a slot), so a binary search finds the largest that fits.
    """
    if not on_gpu:
        return 0, "GPU tier: none (no GPU)"
    budget = hardware.gpu_bytes - gpu_margin_gib * GIB
    lo, hi = 0, num_blocks  # invariant: lo fits, or lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        gpu = predict(mid).gpu
        if gpu.peak_bytes <= budget and gpu.persistent_bytes + reserve <= budget:
            lo = mid
        else:
            hi = mid - 1
    peak = predict(lo).gpu.peak_bytes
    return lo, (
        f"GPU tier: {lo} of {num_blocks} blocks, predicted GPU peak {gib(peak)} of "
        f"{gib(hardware.gpu_bytes)} (margin {gpu_margin_gib:g} GiB"
        + (f", {gib(reserve)} left for the rollout)" if reserve else ")")
    )


def _grad_accum_for(tokens_per_step: int, micro_batch_size: int, seq_len: int) -> int:
    rows = tokens_per_step // seq_len
    if rows < micro_batch_size or rows % micro_batch_size or rows * seq_len != tokens_per_step:
        raise ValueError(
            f"tokens per step {tokens_per_step} must be a multiple of micro_batch_size x "
            f"seq_len = {micro_batch_size * seq_len}"
        )
    return rows // micro_batch_size
