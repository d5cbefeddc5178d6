"""How many streamed blocks the GPU update share takes (engine/gpu_share.py), for "auto".

`pick_share` asks the planner's prediction (planning/estimate.py, whose step time replays the
engine's schedule with the share: planning/timing.py) for 0, 1, 2, ... share blocks, on each
count of staging sets (choices.py STAGING_SET_CHOICES, or the one given). Each
block taken off the CPU worker's tail shortens the host's updates by its CPU AdamW time and
lengthens the share's worker by its states' round trip over the link (beside the weights, on
the same copy streams) and its GPU AdamW, and slows the host's AdamW while its copies take
host memory (planning/share_time.py `share_contention`); the step is bound by the later of the
two (and by compute). The count with the shortest step wins; the search ends at the GPU
budget or after PATIENCE counts in a row that are no shorter. Where the CPU updates do not
bound the step (the GPU compute or the link does), that is 0, and no GPU memory is spent on it.
A second staging set lets one block's states go up while the previous one's come back, for a
second block's staging memory: it wins where the share's copies pace the step and the GPU has
the room (docs/performance.md run 80, an H100, GPT-OSS-20B at 17 layers with int8 states: a
tier of 2 and a share of 12 on two sets, 5.666 s, planned 5.70, against the one-set plan's
tier of 3 and share of 9, 5.921 s).

The GPU tier (planning/gpu_tier.py) takes the GPU memory first. A tier block keeps its master
and states on the GPU (12-16 B/param); a share block holds only its gradient (1-4 B/param)
beside the staging set, so where both are "auto", `trade_tier` gives up tier blocks, one at a
time, while the step predicted with the share their room allows is shorter and host RAM holds
what they gave up (a tier block's states are not on the host). That share may be
none: the replay can predict a shorter step with a tier block fewer and the host updating it
(docs/performance.md run 68: the Qwen3-30B-A3B row with fp32 states, 9 of the 10 tier blocks
that fit, predicted 1.79 against 1.85 s, measured 1.769 against 1.807 s).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from megatrain.choices import STAGING_SET_CHOICES
from megatrain.engine.gpu_share import staging_sets
from megatrain.planning.estimate import Estimate
from megatrain.planning.hardware import gib

PATIENCE = 3
"""Counts in a row no shorter than the best that end a search (of share blocks, or of tier
blocks given up): the contention can make a few share blocks slower than none where more are
faster, and a second staging set's room costs a tier block before the share it allows pays."""


class ShareChoice(NamedTuple):
    blocks: int  # share blocks
    sets: int  # staging sets (1 where fewer than two blocks)
    reason: str | None  # why "auto" chose them; None: the count was given
    step_s: float  # the predicted step with them


def pick_share(
    setting: int | str,
    sets_setting: int | str,
    predict: Callable[..., Estimate],
    streamed: int,
    budget: float,
    *,
    why_none: str | None = None,
) -> ShareChoice:
    """The share's block count for `setting` (a count, or "auto") and staging sets for
    `sets_setting` (a count, or "auto"), the shortest predicted step's within `budget` GPU
    bytes. `predict(share=n, sets=s)`: the run's estimate with n share blocks on s sets;
    `streamed`: the blocks a share can take; `why_none`: why there is no share at all (no GPU,
    ranks)."""
    sets_choices = STAGING_SET_CHOICES if sets_setting == "auto" else (int(sets_setting),)
    if setting != "auto":  # the sets matter from two blocks on
        given = sorted({staging_sets(s, min(int(setting), streamed)) for s in sets_choices})
        options = [(predict(share=int(setting), sets=s), s) for s in given]
        fits = [o for o in options if o[0].gpu.peak_bytes <= budget] or options[:1]
        est, sets = min(fits, key=lambda o: o[0].time.step_s)  # ties: the fewer sets
        return ShareChoice(int(setting), sets, None, est.time.step_s)
    base = predict(share=0)
    if why_none is not None:
        return ShareChoice(0, 1, f"GPU update share: none ({why_none})", base.time.step_s)
    tried = [
        (sets, *_best_count(functools.partial(predict, sets=sets), streamed, budget, base))
        for sets in sets_choices
    ]
    sets, count, est = min(tried, key=lambda r: r[2].time.step_s)  # ties: the fewer sets
    sets = staging_sets(sets, count)
    others = [(s, e.time.step_s) for s, n, e in tried if s != sets and n > 1]
    other = "".join(f"{s} set{'s' * (s > 1)} at best {step:.2f} s; " for s, step in others)
    t = est.time
    on = f" on {sets} staging set{'s' * (sets > 1)}" if count else ""
    return ShareChoice(
        count,
        sets,
        f"GPU update share: {count} blocks{on}, predicted step {t.step_s:.2f} s "
        f"({other}without {base.time.step_s:.2f} s; CPU AdamW "
        f"{t.optimizer_s:.2f} s, the share's copies and GPU AdamW {t.share_s:.2f} s)",
        t.step_s,
    )


def _best_count(
    predict: Callable[..., Estimate], streamed: int, budget: float, base: Estimate
) -> tuple[int, Estimate]:
    """The share count of the shortest predicted step (and its estimate) from 0 (`base`) up,
    until the GPU budget or PATIENCE counts in a row no shorter."""
    count, best, worse = 0, base, 0
    for n in range(1, streamed + 1):
        est = predict(share=n)
        if est.gpu.peak_bytes > budget:
            break  # the peak grows with the count
        worse = worse + 1 if est.time.step_s >= best.time.step_s else 0
        if worse > PATIENCE:
            break
        if not worse:
            best, count = est, n
    return count, best


class TierAndShare(NamedTuple):
    tier: int
    share: ShareChoice
    traded: int  # tier blocks given up (for the share, or for the host's update)
    full_s: float  # the predicted step with every tier block that fits and its share

    def tier_reason(self, blocks: int, reserve: int = 0) -> str:
        """Why `auto` keeps fewer tier blocks than fit (of `blocks`, beside `reserve` bytes
        left for GRPO's resident rollout): the room a larger share takes, or, with no share,
        the host updating them (the replay's shorter step)."""
        why = (
            "their room holds the GPU update share"
            if self.share.blocks
            else "the host updates them beside the next forward"
        )
        beside = f", {gib(reserve)} left for the rollout" if reserve else ""
        return (
            f"GPU tier: {self.tier} of {blocks} blocks ({self.traded} fewer than fit{beside}: "
            f"{why}; predicted step {self.share.step_s:.2f} s against {self.full_s:.2f} s)"
        )


def trade_tier(
    tier: int, pick: Callable[[int], ShareChoice], host_fits: Callable[[int], bool]
) -> TierAndShare:
    """The tier count and share with the shortest predicted step, from `tier` (the most tier
    blocks that fit) down, one tier block at a time until PATIENCE counts in a row are no
    shorter than the best, or the host no longer holds the blocks given up (where it holds
    the full tier's). `pick(t)`: the share beside t tier blocks; `host_fits(t)`: whether host
    RAM holds the run with t tier blocks (while loading too)."""
    full = pick(tier)
    best, worse = TierAndShare(tier, full, 0, full.step_s), 0
    bounded = host_fits(tier)
    for fewer in range(tier - 1, -1, -1):
        if bounded and not host_fits(fewer):
            break  # fewer tier blocks hold more on the host
        choice = pick(fewer)
        if choice.step_s < best.share.step_s:
            best, worse = TierAndShare(fewer, choice, tier - fewer, full.step_s), 0
            continue
        worse += 1
        if worse > PATIENCE:
            break
    return best
