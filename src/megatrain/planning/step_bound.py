"""What a predicted step waits on: the GPU's compute while the GPU is busy for most of the step,
else the busiest resource that leaves it idle (planning/timing.py names them)."""

from __future__ import annotations

GPU_BUSY_BOUND = 0.9
"""The GPU's share of the step (busy: layers, loss, tier AdamW) from which the step counts as
bound by GPU compute; below it the GPU waits on other resources for over a tenth of it."""


def busy_share(compute_s: float, gpu_optimizer_s: float, step_s: float) -> float:
    """The GPU's busy share of a step: its layers and loss (`compute_s`) and the tier's AdamW."""
    return (compute_s + gpu_optimizer_s) / max(step_s, 1e-12)


def step_bound(gpu_busy: float, others: dict[str, float]) -> str:
    """What the step waits on most: the GPU's compute where the GPU is busy (`busy_share`) at
    least GPU_BUSY_BOUND of the step; else the busiest of the other resources, which leaves
    the GPU idle (with clipping the CPU's update waits for the whole backward, so it stalls
    the next forward while busy for less than the GPU)."""
    if gpu_busy >= GPU_BUSY_BOUND:
        return "GPU compute"
    return max(others, key=lambda k: others[k])
