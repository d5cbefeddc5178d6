"""The order of one step's layer work: one schedule, run by the engine, replayed by the planner.

`StepSchedule.of(num_layers, resident, num_slots, boundaries)` lists, for the forward and the
backward, every weight load and every layer visit in the order they are issued. The engine
executes the lists (engine/forward.py, engine/backward.py); the planner's timing model replays
the same lists with costs (planning/timing.py), so the predicted step follows the engine's.

Forward: each layer runs, and the layer `num_slots` after it is loaded into the slot it frees
(the first streamed layers: after the GPU-tier layer `num_slots` ahead of them, or at the start);
the head is loaded with the last layer. A load waits on the host for its block's update, so no
load sits earlier than that depth: the tier's layers are queued on the GPU while the host
updates the streamed blocks (with clipping, after the backward).
Backward: the visits of `BoundaryPlan.backward_uses` (a segment's dropped inputs recomputed
first, then its layers' backward, last first); a visit's weights are loaded `num_slots` visits
ahead, but only once no earlier pending visit still needs the layer in that slot (visits up
and down a segment may map to one slot: the prefetch depth shrinks there, correctness never
does), and not at all where the slot still holds that layer from the forward.

Invariants: GPU-tier layers (the first `resident`) are never loaded; a LOAD of layer j targets
slot (j - resident) % num_slots; every visit of a streamed layer comes after a LOAD of it with
no LOAD of another layer into its slot in between.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.engine.boundaries import BoundaryPlan

LOAD = "load"  # copy a streamed layer's weights into its slot
LOAD_HEAD = "load_head"  # the head's (and a tied table's) weights
RUN = "run"  # the forward of one layer over every micro-batch
RECOMPUTE = "recompute"  # a layer's forward again, for the next layer's dropped input
BACKWARD = "backward"  # a layer's recompute + backward over every micro-batch


@dataclass(frozen=True)
class Op:
    kind: str
    layer: int = -1


@dataclass(frozen=True)
class StepSchedule:
    num_layers: int
    resident: int  # GPU-tier layers: the first ones, never loaded
    num_slots: int  # slots of the streamed layers (0 when every layer is resident)
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]

    @classmethod
    def of(
        cls, num_layers: int, resident: int, num_slots: int, boundaries: BoundaryPlan
    ) -> StepSchedule:
        assert boundaries.num_layers == num_layers, (boundaries.num_layers, num_layers)
        assert num_slots == min(num_slots, num_layers - resident), (num_slots, resident)
        forward, holds = _forward(num_layers, resident, num_slots)
        backward = _backward(boundaries.backward_uses(), resident, num_slots, holds)
        return cls(num_layers, resident, num_slots, tuple(forward), tuple(backward))

    def slot(self, layer: int) -> int:
        assert layer >= self.resident, f"layer {layer} is resident, it has no slot"
        return (layer - self.resident) % self.num_slots


def _forward(n: int, resident: int, num_slots: int) -> tuple[list[Op], dict[int, int]]:
    """The forward's ops, and which layer each slot holds after it.

    Streamed layer j is loaded right after layer j - num_slots runs: the one that frees its
    slot, or for the first streamed layers the GPU-tier layer as far ahead (at the start when
    there is none). A load waits on the host for the block's update, so it sits no earlier than
    its copy needs: the tier layers before it are queued on the GPU first, and their compute
    overlaps the host's updates with clipping. The head is loaded with the last layer, or
    with no streamed layer, before the last layer runs."""
    ops: list[Op] = []

    def load(j: int) -> None:
        ops.append(Op(LOAD, j))
        if j == n - 1:
            ops.append(Op(LOAD_HEAD))

    for j in range(resident, num_slots):  # no layer num_slots ahead of them
        load(j)
    for i in range(n):
        if num_slots == 0 and i == n - 1:  # every layer resident: the head one layer ahead
            ops.append(Op(LOAD_HEAD))
        ops.append(Op(RUN, i))
        if num_slots and resident <= i + num_slots < n:
            load(i + num_slots)
    holds = {(op.layer - resident) % num_slots: op.layer for op in ops if op.kind == LOAD}
    return ops, holds


def _backward(
    uses: list[tuple[int, bool]], resident: int, num_slots: int, holds: dict[int, int]
) -> list[Op]:
    layers = [i for i, _ in uses]
    ops: list[Op] = []
    issued = 0  # visits [0, issued) have their load issued (or need none)

    def slot(layer: int) -> int:
        return (layer - resident) % num_slots

    def pump(done: int) -> None:
        """Visits before `done` are finished: issue the loads that are now safe."""
        nonlocal issued
        while issued < len(layers) and issued < done + num_slots:
            layer, pending = layers[issued], layers[done:issued]
            if layer >= resident:
                if any(m >= resident and m != layer and slot(m) == slot(layer) for m in pending):
                    return
                if holds.get(slot(layer)) != layer:
                    ops.append(Op(LOAD, layer))
                    holds[slot(layer)] = layer
            issued += 1

    pump(0)  # no copy for layers still resident from the forward
    for t, (i, recompute) in enumerate(uses):
        ops.append(Op(RECOMPUTE if recompute else BACKWARD, i))
        pump(t + 1)
    return ops
