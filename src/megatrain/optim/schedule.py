"""Learning-rate schedules: constant, linear or cosine decay, each with linear warmup.

`lr_at(step)` is a pure function of the optimizer step (0-based), so a resumed run gets exactly
the learning rates of an uninterrupted one. Warmup rises linearly to the peak at step
`warmup_steps - 1` (no step is wasted at lr 0); decay then runs from the peak at step
`warmup_steps` to `min_lr_ratio * peak` at the last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    peak_lr: float
    total_steps: int
    kind: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"optimizer.lr_scheduler={self.kind!r} must be one of {SCHEDULES}")
        if self.total_steps < 1:
            raise ValueError(
                f"the run has {self.total_steps} optimizer steps; it needs >= 1 "
                "(more data, more epochs, or training.max_steps)"
            )

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)


def warmup_steps_for(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    return warmup_steps if warmup_steps > 0 else round(warmup_ratio * total_steps)
