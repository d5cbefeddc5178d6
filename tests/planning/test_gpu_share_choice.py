"""How "auto" chooses the GPU update share (planning/gpu_share.py) and what slows the host's
AdamW beside it (planning/share_time.py `share_contention`), on made-up step times: the
choice's rules alone, apart from the step-time model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from megatrain.planning.gpu_share import PATIENCE, ShareChoice, pick_share, trade_tier
from megatrain.planning.share_time import SHARE_CPU_SLOWDOWN, share_contention

GIB = 2**30


def _predictor(
    steps: list[float], peak_gib: list[float] | None = None, two_sets: list[float] | None = None
) -> Any:
    """predict(share=n, sets=s): an estimate with step steps[n] (on two sets two_sets[n], and
    1 GiB more GPU peak there) and GPU peak peak_gib[n]."""

    def predict(share: int, sets: int = 1) -> Any:
        peak = (peak_gib or [0.0] * len(steps))[share] + (sets > 1 and share > 1)
        step = (two_sets or steps)[share] if sets > 1 and share > 1 else steps[share]
        return SimpleNamespace(
            gpu=SimpleNamespace(peak_bytes=int(peak * GIB)),
            time=SimpleNamespace(step_s=step, optimizer_s=1.0, share_s=0.1 * share),
        )

    return predict


def test_auto_looks_past_a_few_slower_counts() -> None:
    """The contention makes one or two blocks slower than none where four are faster."""
    steps = [4.0, 4.1, 4.05, 3.5, 3.0, 3.2, 3.3, 3.4, 3.5, 2.0]
    choice = pick_share("auto", 1, _predictor(steps), len(steps) - 1, 80 * GIB)
    assert choice.blocks == 4 and choice.sets == 1 and choice.step_s == 3.0
    assert choice.reason is not None and "4 blocks on 1 staging set, predicted step 3.00 s" in (
        choice.reason
    )
    # after PATIENCE counts in a row no shorter than the best, the search ends: 9 is not seen
    assert PATIENCE == 3


def test_auto_stops_at_the_gpu_budget_and_a_given_count_is_kept() -> None:
    steps = [4.0, 3.5, 3.0, 2.5]
    peaks = [10.0, 20.0, 30.0, 40.0]  # the third block would not fit 35 GiB
    assert pick_share("auto", 1, _predictor(steps, peaks), 3, 35 * GIB).blocks == 2
    assert pick_share(3, 1, _predictor(steps, peaks), 3, 35 * GIB)[:3] == (3, 1, None)
    assert pick_share("auto", "auto", _predictor(steps), 3, 80 * GIB, why_none="ranks")[:3] == (
        0,
        1,
        "GPU update share: none (ranks)",
    )


def test_auto_sets_take_the_second_set_where_its_step_is_shorter_and_fits() -> None:
    """Two staging sets where they predict the shorter step within the budget; the reason
    names the other count's best; ties, a share of one block, or no room keep one set."""
    steps = [4.0, 3.6, 3.3, 3.1, 3.0]
    two = [4.0, 3.6, 3.0, 2.7, 2.6]
    choice = pick_share("auto", "auto", _predictor(steps, two_sets=two), 4, 80 * GIB)
    assert (choice.blocks, choice.sets, choice.step_s) == (4, 2, 2.6)
    assert choice.reason is not None
    assert "4 blocks on 2 staging sets, predicted step 2.60 s (1 set at best 3.00 s;" in (
        choice.reason
    )
    assert pick_share("auto", "auto", _predictor(steps, two_sets=steps), 4, 80 * GIB).sets == 1
    assert pick_share("auto", "auto", _predictor(steps[:2], two_sets=two[:2]), 1, 80 * GIB)[:2] == (
        1,
        1,
    )
    peaks = [1.0, 2.0, 3.0, 4.0, 5.0]  # two sets cost 1 GiB more: at 5.2 GiB, 3 blocks on two
    tight = pick_share("auto", "auto", _predictor(steps, peaks, two), 4, 5.2 * GIB)
    assert (tight.blocks, tight.sets, tight.step_s) == (3, 2, 2.7)
    given = pick_share(4, "auto", _predictor(steps, peaks, two), 4, 5.5 * GIB)  # 2 sets: 6 GiB
    assert (given.blocks, given.sets, given.reason) == (4, 1, None)
    assert pick_share(4, 2, _predictor(steps, peaks, two), 4, 5.5 * GIB).sets == 2  # as given


ANY_HOST = lambda t: True  # noqa: E731  # a host that holds the run with any tier


def _choice(count: int, step_s: float, reason: str | None = None) -> ShareChoice:
    return ShareChoice(count, 1, reason, step_s)


def test_tier_blocks_are_given_up_while_the_share_shortens_the_step() -> None:
    """trade_tier(tier, pick): from the most tier blocks that fit, one fewer at a time, past up
    to PATIENCE counts no shorter, for the shortest step with the share that room allows."""
    share_of = {6: 0, 5: 1, 4: 1, 3: 3, 2: 5, 1: 6, 0: 7}  # fewer tier blocks: a larger share
    step = {6: 2.5, 5: 2.6, 4: 2.55, 3: 2.4, 2: 2.3, 1: 2.35, 0: 2.2}
    traded = trade_tier(
        6, lambda t: _choice(share_of[t], step[t], f"share {share_of[t]}"), ANY_HOST
    )
    assert (traded.tier, traded.share.blocks, traded.share.reason, traded.traded) == (
        0,
        7,
        "share 7",
        6,
    )
    assert traded.tier_reason(8) == (
        "GPU tier: 0 of 8 blocks (6 fewer than fit: their room holds the GPU update share; "
        "predicted step 2.20 s against 2.50 s)"
    )
    # PATIENCE + 1 counts in a row no shorter end the walk: 0 is not seen
    ends = {6: 2.5, 5: 2.6, 4: 2.55, 3: 2.5, 2: 2.7, 1: 2.6, 0: 2.0}
    assert trade_tier(6, lambda t: _choice(share_of[t], ends[t]), ANY_HOST).tier == 6
    kept = trade_tier(4, lambda t: _choice(share_of[t], 2.0 + 0.1 * (4 - t)), ANY_HOST)
    assert (kept.tier, kept.share.blocks, kept.traded) == (4, 1, 0)
    # the host holds the run with 3 or more tier blocks: the walk stops there
    held = trade_tier(6, lambda t: _choice(share_of[t], step[t]), lambda t: t >= 3)
    assert (held.tier, held.share.blocks, held.traded) == (3, 3, 3)
    # a host that holds not even the full tier: the fit check says so, the walk is the step's
    assert trade_tier(6, lambda t: _choice(share_of[t], step[t]), lambda t: False).tier == 0


def test_a_tier_traded_for_no_share_says_the_host_updates_those_blocks() -> None:
    """Fewer tier blocks with no share at all (the host updating them beside the next forward
    predicts the shorter step): the reason names that, not a share."""
    traded = trade_tier(3, lambda t: _choice(0, {3: 1.85, 2: 1.79, 1: 1.8, 0: 1.9}[t]), ANY_HOST)
    assert (traded.tier, traded.share.blocks, traded.traded) == (2, 0, 1)
    assert traded.tier_reason(14) == (
        "GPU tier: 2 of 14 blocks (1 fewer than fit: the host updates them beside the next "
        "forward; predicted step 1.79 s against 1.85 s)"
    )


@pytest.mark.parametrize(
    ("share_s", "cpu_s", "factor"),
    [
        (0.0, 1.0, 1.0),  # no share: no contention
        (1.0, 0.0, 1.0),  # no host update to slow
        (0.5, 1.0, 1.0 + (SHARE_CPU_SLOWDOWN - 1.0) * 0.5),  # copies overlap half the CPU's time
        (3.0, 1.0, SHARE_CPU_SLOWDOWN),  # all of it
    ],
)
def test_the_host_adamw_slows_over_the_part_the_copies_overlap(
    share_s: float, cpu_s: float, factor: float
) -> None:
    assert share_contention(share_s, cpu_s) == pytest.approx(factor, rel=1e-12)
