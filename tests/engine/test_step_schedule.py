"""The step schedule (engine/schedule.py): the order the engine runs and the planner replays.

Checked by simulating the slots: every visit of a streamed layer finds that layer's weights in
its slot (loaded before, not overwritten since), GPU-tier layers are never loaded, the forward
visits every layer once in order, the backward visits are `BoundaryPlan.backward_uses`, and a
load is never issued into a slot an earlier pending visit still needs. Layouts: every input
kept, one kept every K layers (recompute visits up and down a segment), a GPU tier, one slot,
more slots than layers left.
"""

from __future__ import annotations

import pytest

from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.schedule import BACKWARD, LOAD, LOAD_HEAD, RECOMPUTE, RUN, Op, StepSchedule

CASES = [  # (layers, resident, slots, every)
    (6, 0, 2, 1),
    (6, 0, 1, 1),
    (7, 0, 2, 3),
    (7, 0, 3, 3),
    (8, 2, 2, 2),
    (5, 3, 2, 1),
    (4, 4, 0, 1),
    (9, 1, 4, 4),
]


@pytest.mark.parametrize(("n", "resident", "slots", "every"), CASES)
def test_every_visit_finds_its_weights(n: int, resident: int, slots: int, every: int) -> None:
    plan = BoundaryPlan.make(n, every=every)
    s = StepSchedule.of(n, resident, slots, plan)
    holds: dict[int, int] = {}
    for phase, ops in (("forward", s.forward), ("backward", s.backward)):
        visits = [op for op in ops if op.kind in (RUN, RECOMPUTE, BACKWARD)]
        for k, op in enumerate(ops):
            if op.kind == LOAD:
                assert op.layer >= resident, f"{phase}: resident layer {op.layer} loaded"
                done = sum(o.kind in (RUN, RECOMPUTE, BACKWARD) for o in ops[:k])
                pending = [v.layer for v in visits[done:] if v.layer >= resident]
                # the visits before this layer's own in the pending window must not need the slot
                before = pending[: pending.index(op.layer)] if op.layer in pending else pending
                assert all(s.slot(m) != s.slot(op.layer) for m in before), (phase, k)
                holds[s.slot(op.layer)] = op.layer
            elif op.kind != LOAD_HEAD and op.layer >= resident:
                assert holds.get(s.slot(op.layer)) == op.layer, (phase, k, op)
    assert [op.layer for op in s.forward if op.kind == RUN] == list(range(n))
    uses = [(op.layer, op.kind == RECOMPUTE) for op in s.backward if op.kind != LOAD]
    assert uses == plan.backward_uses()
    assert sum(op.kind == LOAD_HEAD for op in s.forward) == 1
    streamed_loads = sum(op.kind == LOAD for op in s.forward)
    assert streamed_loads == n - resident  # each streamed layer once in the forward


def test_the_last_layers_stay_for_the_backward() -> None:
    """Every input kept: the backward reloads all but the `num_slots` last layers, which are
    still in their slots from the forward."""
    s = StepSchedule.of(6, 0, 2, BoundaryPlan.make(6))
    assert [op.layer for op in s.backward if op.kind == LOAD] == [3, 2, 1, 0]


@pytest.mark.parametrize(("n", "resident", "slots", "every"), CASES)
def test_a_load_waits_no_earlier_than_its_depth(
    n: int, resident: int, slots: int, every: int
) -> None:
    """A forward load waits on the host for its block's update, so none sits earlier than
    `num_slots` layers ahead: streamed layer j is loaded right after layer j - num_slots runs
    (a GPU-tier layer for the first ones), at the start only where there is no such layer.
    With clipping the tier's layers are then queued on the GPU while the host updates the
    streamed blocks (docs/performance.md run 69)."""
    s = StepSchedule.of(n, resident, slots, BoundaryPlan.make(n, every=every))
    ops = list(s.forward)
    for k, op in enumerate(ops):
        if op.kind != LOAD:
            continue
        runs = [o.layer for o in ops[:k] if o.kind == RUN]
        assert runs[-1:] == ([op.layer - slots] if op.layer >= slots else []), (k, op, runs)
    head = ops.index(Op(LOAD_HEAD))
    if slots:  # with the last layer's load
        assert ops[head - 1] == Op(LOAD, n - 1)
    else:  # every layer resident: one layer ahead of its use
        assert [o.layer for o in ops[:head] if o.kind == RUN] == list(range(n - 1))
