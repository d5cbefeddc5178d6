"""How "auto" chooses the GPU update share (planning/gpu_share.py) and what slows the host's
AdamW beside it (planning/share_time.py `share_contention`), on made-up step times: the
choice's rules alone, apart from the step-time model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from megatrain.planning.gpu_share import PATIENCE, pick_share, trade_tier
from megatrain.planning.share_time import SHARE_CPU_SLOWDOWN, share_contention

GIB = 2**30


def _predictor(steps: list[float], peak_gib: list[float] | None = None) -> Any:
    """predict(share=n): an estimate with step steps[n] and GPU peak peak_gib[n]."""

    def predict(share: int) -> Any:
        peak = (peak_gib or [0.0] * len(steps))[share]
        return SimpleNamespace(
            gpu=SimpleNamespace(peak_bytes=int(peak * GIB)),
            time=SimpleNamespace(step_s=steps[share], optimizer_s=1.0, share_s=0.1 * share),
        )

    return predict


def test_auto_looks_past_a_few_slower_counts() -> None:
    """The contention makes one or two blocks slower than none where four are faster."""
    steps = [4.0, 4.1, 4.05, 3.5, 3.0, 3.2, 3.3, 3.4, 3.5, 2.0]
    count, reason = pick_share("auto", _predictor(steps), len(steps) - 1, 80 * GIB)
    assert count == 4 and reason is not None and "4 blocks, predicted step 3.00 s" in reason
    # after PATIENCE counts in a row no shorter than the best, the search ends: 9 is not seen
    assert PATIENCE == 3


def test_auto_stops_at_the_gpu_budget_and_a_given_count_is_kept() -> None:
    steps = [4.0, 3.5, 3.0, 2.5]
    peaks = [10.0, 20.0, 30.0, 40.0]  # the third block would not fit 35 GiB
    assert pick_share("auto", _predictor(steps, peaks), 3, 35 * GIB)[0] == 2
    assert pick_share(3, _predictor(steps, peaks), 3, 35 * GIB) == (3, None)
    assert pick_share("auto", _predictor(steps), 3, 80 * GIB, why_none="ranks") == (
        0,
        "GPU update share: none (ranks)",
    )


def test_tier_blocks_are_given_up_while_the_share_shortens_the_step() -> None:
    """trade_tier(tier, pick, step_s): from the most tier blocks that fit, one fewer at a time
    while the step with the share that room allows is shorter."""
    share_of = {4: 1, 3: 3, 2: 5, 1: 6, 0: 7}  # fewer tier blocks: room for a larger share
    step = {4: 2.6, 3: 2.4, 2: 2.3, 1: 2.35, 0: 2.2}  # 0 would be shorter, but 1 ends the walk
    traded = trade_tier(4, lambda t: (share_of[t], f"share {share_of[t]}"), lambda t, n: step[t])
    assert (traded.tier, traded.share, traded.share_reason, traded.traded) == (2, 5, "share 5", 2)
    assert traded.tier_reason(6) == (
        "GPU tier: 2 of 6 blocks (2 fewer than fit: their room holds the GPU update share; "
        "predicted step 2.30 s against 2.60 s)"
    )
    kept = trade_tier(4, lambda t: (share_of[t], None), lambda t, n: 2.0 + 0.1 * (4 - t))
    assert (kept.tier, kept.share, kept.traded) == (4, 1, 0)


def test_a_tier_traded_for_no_share_says_the_host_updates_those_blocks() -> None:
    """Fewer tier blocks with no share at all (the host updating them beside the next forward
    predicts the shorter step): the reason names that, not a share."""
    traded = trade_tier(3, lambda t: (0, None), lambda t, n: {3: 1.85, 2: 1.79, 1: 1.8}[t])
    assert (traded.tier, traded.share, traded.traded) == (2, 0, 1)
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
