"""The closing `done:` line of `train`, `dpo` and `grpo`: one format for the three.

    done: 50 steps (resumed at step 10), loss 2.1234 at step 11 -> 1.5678,
          mean reward 0.300 (steps 11-20) -> 0.850 (steps 41-50); checkpoint DIR; ...

Invariant: the per-step series a recipe returns are of this process's steps, so a resumed run's
first value is that of the step after its checkpoint (`resumed_at` + 1); every number printed
is labelled with the steps it is of (docs/checkpoints.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

WINDOW_STEPS = 10
"""A mean is taken over this many steps at the start and at the end of the run's series."""


def done_line(
    steps: int,
    resumed_at: int,
    *,
    losses: Sequence[float] = (),
    means: Mapping[str, Sequence[float]] | None = None,
    eval_loss: float | None = None,
    checkpoint: Path | None = None,
    export_dir: Path | None = None,
) -> str:
    """`steps` in all, of which the process ran those after `resumed_at` (0: a fresh run);
    `losses` as first -> last, each of `means` (name -> a value per step) as its mean over the
    first and the last WINDOW_STEPS steps."""
    line = f"done: {steps} steps" + (f" (resumed at step {resumed_at})" if resumed_at else "")
    if losses:
        where = f" at step {resumed_at + 1}" if resumed_at else ""
        line += f", loss {losses[0]:.4f}{where} -> {losses[-1]:.4f}"
    for name, values in (means or {}).items():
        if values:
            n = min(WINDOW_STEPS, len(values))
            head, tail = values[:n], values[-n:]
            first, last = resumed_at + 1, resumed_at + len(values)
            line += (
                f", {name} {sum(head) / n:.3f} ({_steps(first, first + n - 1)}) -> "
                f"{sum(tail) / n:.3f} ({_steps(last - n + 1, last)})"
            )
    if eval_loss is not None:
        line += f", eval loss {eval_loss:.4f}"
    return (
        line
        + (f"; checkpoint {checkpoint}" if checkpoint else "")
        + (f"; Hugging Face model {export_dir}" if export_dir else "")
    )


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"
