"""How many streamed blocks the GPU update share takes (engine/gpu_share.py), for "auto".

`pick_share` asks the planner's prediction (planning/estimate.py, whose step time replays the
engine's schedule with the share: planning/timing.py) for 0, 1, 2, ... share blocks. Each
block taken off the CPU worker's tail shortens the host's updates by its CPU AdamW time and
lengthens the share's worker by its states' round trip over the link (beside the weights, on
the same copy streams) and its GPU AdamW, and slows the host's AdamW while its copies take
host memory (planning/share_time.py `share_contention`); the step is bound by the later of the
two (and by compute). The count with the shortest step wins; the search ends at the GPU
budget or after PATIENCE counts in a row that are no shorter. Where the CPU updates do not
bound the step (the GPU compute or the link does), that is 0, and no GPU memory is spent on it.

The GPU tier (planning/gpu_tier.py) takes the GPU memory first. A tier block keeps its master
and states on the GPU (12-16 B/param); a share block holds only its gradient (1-4 B/param)
beside the staging set, so where both are "auto", `trade_tier` gives up tier blocks, one at a
time, while the step predicted with the share their room allows is shorter. That share may be
none: the replay can predict a shorter step with a tier block fewer and the host updating it
(docs/performance.md run 68: the Qwen3-30B-A3B row with fp32 states, 9 of the 10 tier blocks
that fit, predicted 1.79 against 1.85 s, measured 1.769 against 1.807 s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from megatrain.planning.estimate import Estimate

PATIENCE = 3
"""Share counts in a row no shorter than the best that end the search (the contention can make
a few blocks slower than none where more are faster)."""


def pick_share(
    setting: int | str,
    predict: Callable[..., Estimate],
    streamed: int,
    budget: float,
    *,
    why_none: str | None = None,
) -> tuple[int, str | None]:
    """The share's block count for `setting` (a count, or "auto"), and why "auto" chose it
    (None: it was given). `predict(share=n)`: the run's estimate with n share blocks;
    `streamed`: the blocks a share can take; `budget`: the GPU bytes its peak may reach;
    `why_none`: why there is no share at all (no GPU, ranks)."""
    if setting != "auto":
        return int(setting), None
    if why_none is not None:
        return 0, f"GPU update share: none ({why_none})"
    base = best = predict(share=0)
    count, worse = 0, 0
    for n in range(1, streamed + 1):
        est = predict(share=n)
        if est.gpu.peak_bytes > budget:
            break  # the peak grows with the count
        worse = worse + 1 if est.time.step_s >= best.time.step_s else 0
        if worse > PATIENCE:
            break
        if not worse:
            best, count = est, n
    return count, (
        f"GPU update share: {count} blocks, predicted step {best.time.step_s:.2f} s "
        f"(without {base.time.step_s:.2f} s; CPU AdamW {best.time.optimizer_s:.2f} s, the "
        f"share's copies and GPU AdamW {best.time.share_s:.2f} s)"
    )


class TierAndShare(NamedTuple):
    tier: int
    share: int
    share_reason: str | None
    traded: int  # tier blocks given up (for the share, or for the host's update)
    step_s: float  # the predicted step with these counts
    full_s: float  # ... with every tier block that fits and its share

    def tier_reason(self, blocks: int) -> str:
        """Why `auto` keeps fewer tier blocks than fit (of `blocks`): the room a larger share
        takes, or, with no share, the host updating them (the replay's shorter step)."""
        why = (
            "their room holds the GPU update share"
            if self.share
            else "the host updates them beside the next forward"
        )
        return (
            f"GPU tier: {self.tier} of {blocks} blocks ({self.traded} fewer than fit: {why}; "
            f"predicted step {self.step_s:.2f} s against {self.full_s:.2f} s)"
        )


def trade_tier(
    tier: int, pick: Callable[[int], tuple[int, str | None]], step_s: Callable[[int, int], float]
) -> TierAndShare:
    """The tier and share counts with the shortest predicted step, from `tier` (the most tier
    blocks that fit) down, one tier block at a time until a step is no shorter. `pick(t)`:
    the share's count beside t tier blocks, and why; `step_s(t, n)`: the predicted step."""
    share, reason = pick(tier)
    full_s = step_s(tier, share)
    best = TierAndShare(tier, share, reason, 0, full_s, full_s)
    for fewer in range(tier - 1, -1, -1):
        share, reason = pick(fewer)
        seconds = step_s(fewer, share)
        if seconds >= best.step_s:
            break
        best = TierAndShare(fewer, share, reason, tier - fewer, seconds, full_s)
    return best
