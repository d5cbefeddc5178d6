"""The rows of docs/performance.md run 80 (one H100, 79.65 GiB as torch reports it, of a
16-vCPU 125 GiB host), as the planner sees them on the suite's default host model (the H100
test host's link and CPU rates, that GPU's and host's memory given): GPT-OSS-20B cut to 17
layers, int8 states, 64k tokens a step (32 pre-training rows of 2048), clipping 1.0, bf16.

Checked at the GPU tier, update share and staging sets the run had, as `auto` picked them then
(two sets carry a share of 12 beside a tier of 2; with one set the plan kept a tier of 3 and a
share of 9): the GPU peak (reserved) not under the run's by more than 2% (an under-prediction
is an OOM) nor over it by more than 15%; the host RSS within 3%; the step within 15% (the host
model's rates are not this host's: its int8 CPU update ran at 2.62 Gparams/s against the
model's 3.12). A check of the model against recorded measurements, not a timing of this
machine.

Run 80's engine held an fp32 gradient per tier block (4 B/param; tier_before_landing.py), which
the engine since lands in the block's bf16 weights: the planned peak is compared as that
engine's, today's plus what it held beyond it. So `auto` now keeps at least the run's tier
blocks, and its predicted step is no longer than with the run's counts."""

from __future__ import annotations

from typing import Any

import pytest
from tier_before_landing import held_before_landing, row_spec

import shapes
from megatrain.planning.hardware import GIB, Hardware
from predict import cli_row_plan

H100_HOST = Hardware().with_overrides(gpu_gib=79.65, host_gib=125)
AUTO: dict[str, Any] = {"optimizer.state_dtype": "int8", "optimizer.gpu_update_blocks": "auto"}

ROWS: dict[
    str, tuple[dict[str, Any], tuple[int, int, int], float, float, float]
] = {  # name: (settings, (tier, share, sets), step s, GPU peak reserved GiB, host RSS GiB)
    "defaults": (AUTO, (2, 12, 2), 5.666, 76.58, 102.89),
    "one staging set": (AUTO | {"optimizer.gpu_update_sets": 1}, (3, 9, 1), 5.921, 75.06, 96.61),
    "every update on the CPU": (
        AUTO | {"memory.gpu_state_blocks": 0, "optimizer.gpu_update_blocks": 0},
        (0, 0, 1),
        9.325,
        29.04,
        114.96,
    ),
}


def _given(tier: int, share: int, sets: int) -> dict[str, Any]:
    """The run's counts, given: `auto` picks others since."""
    return {
        "memory.gpu_state_blocks": tier,
        "optimizer.gpu_update_blocks": share,
        "optimizer.gpu_update_sets": sets,
    }


@pytest.mark.parametrize("row", list(ROWS))
def test_run_80_rows(row: str) -> None:
    settings, counts, step_s, gpu_gib, host_gib = ROWS[row]
    plan = cli_row_plan(shapes.GPT_OSS_20B_17, H100_HOST, **settings | _given(*counts))
    est, engine = plan.estimate, plan.engine
    assert (plan.gpu_state_blocks, engine.gpu_update_blocks, engine.share_sets) == counts
    # measured before the tier's gradient landed in its weights: that engine held `before` more
    before = held_before_landing(row_spec(shapes.GPT_OSS_20B_17), plan.setup.engine, est.gpu)
    peak = (est.gpu.peak_bytes + before) / GIB
    assert -0.02 <= peak / gpu_gib - 1 <= 0.15, (row, peak)
    assert abs(est.host.total_bytes / GIB / host_gib - 1) <= 0.03, (row, est.host.total_bytes)
    assert abs(est.time.step_s / step_s - 1) <= 0.15, (row, est.time.step_s)


@pytest.mark.parametrize("row", [r for r in ROWS if ROWS[r][1][0]])
def test_auto_keeps_at_least_the_runs_tier(row: str) -> None:
    """A tier block costs 4 B/param less than in run 80: `auto` keeps at least the run's tier
    blocks (its share and sets may differ), for a predicted step no longer than the run's
    counts'."""
    settings, counts, *_ = ROWS[row]
    auto = cli_row_plan(shapes.GPT_OSS_20B_17, H100_HOST, **settings)
    ran = cli_row_plan(shapes.GPT_OSS_20B_17, H100_HOST, **settings | _given(*counts))
    assert auto.gpu_state_blocks >= counts[0], (row, auto.tier_reason, auto.share_reason)
    assert auto.estimate.time.step_s <= ran.estimate.time.step_s, row
