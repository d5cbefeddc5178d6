"""The engine's step as timestamps: the planner's replay of the engine's schedule.

`Replay(costs).run(steps)` walks the engine's own loads and layer visits (engine/schedule.py)
with three streams (compute, H2D, D2H), the host thread and the optimizer worker: slots are
refilled when the visit `num_slots` earlier is done with them, the next forward waits for each
block's update before copying it, the worker takes the landed block the next forward needs
first; without clipping updates start as gradients land, with clipping all start after the
backward (engine/engine.py). The GPU update share's blocks (engine/gpu_share.py) ship no
gradient; a second worker updates them one at a time, in forward order, each its states up on
the H2D stream and back on the D2H stream (the link the weights use: the next forward's loads
queue behind them). planning/timing.py builds the costs and reads the last step.
`forward_passes(passes)` replays forward-only passes (log-probs without gradients: DPO's
reference pass) the same way, without backward and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.engine.schedule import LOAD, LOAD_HEAD, RECOMPUTE, StepSchedule


@dataclass(frozen=True)
class Costs:
    fwd_s: list[float]  # per layer, all micro-batches
    bwd_s: list[float]
    loss_s: float
    head_fwd_s: float  # the head's forward alone (a log-prob pass): 2 of the loss's 6 x V x D x T
    h2d_s: list[float]  # per layer
    h2d_head_s: float  # head block, plus the whole table when tied
    d2h_s: list[float]  # per layer
    d2h_head_s: float
    d2h_embed_s: float
    opt_s: list[float]  # per block in forward order: embedding, layers, head (0: GPU tier)
    tier_opt_s: list[float]  # per block as opt_s: AdamW on the GPU (0: host blocks)
    share_up_s: list[float]  # per block as opt_s: a share block's states up + its GPU AdamW
    share_down_s: list[float]  # ... its master, states and weights back (0: not in the share)
    share_sets: int  # the share's staging sets (EnginePlan.share_sets)
    fwd_call_s: list[float]  # host issue time per layer forward (all micro-batches)
    bwd_call_s: list[float]  # per layer recompute + backward
    loss_call_s: float
    schedule: StepSchedule  # the engine's order of loads and layer visits
    tier_embed: bool  # the embedding is in the GPU tier
    tier_head: bool  # the head is in the GPU tier
    clipping: bool


class Replay:
    """The engine's step as timestamps: host `t`, compute `g`, copy streams `h` and `d`."""

    def __init__(self, c: Costs) -> None:
        self.c = c
        n = len(c.fwd_s)
        self.t = self.g = self.h = self.d = self.worker = self.share_worker = 0.0
        self.updated = [0.0] * (n + 2)  # block (forward order) -> its last update's end
        self.slot_ready = [0.0] * c.schedule.num_slots
        self.slot_free = [0.0] * c.schedule.num_slots
        self.head_ready = self.head_free = 0.0
        self.tasks: list[tuple[int, float, float]] = []  # (order, submitted, landed)
        self.waited = 0.0  # the last step's host time waiting for updates (worker.wait)

    def run(self, steps: int) -> float:
        duration = 0.0
        for _ in range(steps):
            start, self.waited = self.t, 0.0
            self._forward()
            self._loss()
            self._backward()
            self._optimizer()
            duration = self.t - start
        return duration

    def forward_passes(self, passes: int) -> float:
        """Forward-only passes (engine.logprobs: a reference pass), back to back: the step's
        forward visits and loads, the head's forward, no backward and no optimizer; each pass
        ends on the host's read of its log-probs (a sync point). The last pass's duration."""
        duration = 0.0
        for _ in range(passes):
            start = self.t
            self._forward()
            self.t += self.c.loss_call_s
            self.head_free = self._compute(self.head_ready, self.c.head_fwd_s)
            self.t = max(self.t, self.g)  # sync point: the log-probs come to the host
            duration = self.t - start
        return duration

    def _wait_update(self, *done: float) -> None:
        """Host sync point: worker.wait(block), until the blocks' updates are `done`."""
        ready = max(done)
        self.waited += max(0.0, ready - self.t)
        self.t = max(self.t, ready)

    def _load(self, i: int, wait_update: bool) -> None:
        if wait_update:
            self._wait_update(self.updated[1 + i])
        s = self.c.schedule.slot(i)
        begin = max(self.t, self.h, self.slot_free[s])
        self.h = self.slot_ready[s] = begin + self.c.h2d_s[i]

    def _load_head(self) -> None:
        self._wait_update(self.updated[-1], self.updated[0])
        self.h = self.head_ready = max(self.t, self.h, self.head_free) + self.c.h2d_head_s

    def _compute(self, ready: float, seconds: float) -> float:
        self.g = max(self.g, ready, self.t) + seconds
        return self.g

    def _slot_compute(self, i: int, ready: float, seconds: float) -> None:
        """Layer i's compute once `ready` and its weights are in; a streamed layer's slot is
        free again after it (a GPU-tier layer has no slot)."""
        if i < self.c.schedule.resident:
            self._compute(ready, seconds)
            return
        s = self.c.schedule.slot(i)
        self.slot_free[s] = self._compute(max(ready, self.slot_ready[s]), seconds)

    def _forward(self) -> None:
        c = self.c
        self._wait_update(self.updated[0])  # the embedding rows come from updated weights
        for op in c.schedule.forward:
            if op.kind == LOAD:
                self._load(op.layer, wait_update=True)
            elif op.kind == LOAD_HEAD:
                self._load_head()
            else:
                self._layer_forward(op.layer)

    def _layer_forward(self, i: int) -> None:
        """Layer i's forward (or a recompute visit): launched, then run once its slot is in."""
        self.t += self.c.fwd_call_s[i]
        self._slot_compute(i, 0.0, self.c.fwd_s[i])

    def _ship(self, order: int, seconds: float) -> float:
        """A block's gradient is complete: copied down (a share block's stays); when its
        accumulator is free again."""
        if self.c.share_up_s[order]:
            self.tasks.append((order, self.t, self.g))
            return self.g
        self.d = max(self.d, self.g) + seconds
        self.tasks.append((order, self.t, self.d))
        return self.d

    def _loss(self) -> None:
        self.t += self.c.loss_call_s
        self.head_free = self._compute(self.head_ready, self.c.loss_s)
        self._finish(len(self.c.fwd_s) + 1, self.c.tier_head, self.c.d2h_head_s)

    def _finish(self, order: int, in_tier: bool, d2h_s: float) -> None:
        """A head or embedding gradient is complete: shipped, or updated on the GPU."""
        if not in_tier:
            self._ship(order, d2h_s)
        elif not self.c.clipping:
            self.g += self.c.tier_opt_s[order]

    def _backward(self) -> None:
        c = self.c
        acc_free = [0.0, 0.0]  # the two gradient accumulators, free once copied out
        for op in c.schedule.backward:
            i = op.layer
            if op.kind == LOAD:
                self._load(i, wait_update=False)
            elif op.kind == RECOMPUTE:
                self._layer_forward(i)
            elif i < c.schedule.resident:  # GPU tier: own gradient, AdamW on the compute stream
                self.t += c.bwd_call_s[i]
                self._compute(0.0, c.bwd_s[i])
                if not c.clipping:
                    self.g += c.tier_opt_s[1 + i]
            else:
                self.t += c.bwd_call_s[i]
                self._slot_compute(i, acc_free[i % 2], c.bwd_s[i])
                acc_free[i % 2] = self._ship(1 + i, c.d2h_s[i])
        self._finish(0, c.tier_embed, c.d2h_embed_s)
        self.t = max(self.t, self.g)  # sync point: the gradient norm
        if c.clipping:  # the GPU tier's updates are queued first, then the host's
            self.g += sum(c.tier_opt_s)
            self.tasks = sorted((order, self.t, landed) for order, _, landed in self.tasks)

    def _optimizer(self) -> None:
        """The worker: among submitted tasks whose gradient landed, lowest forward order
        first; with none landed, it blocks on the oldest submitted one."""
        share = sorted(task for task in self.tasks if self.c.share_up_s[task[0]])
        self._share_updates(share)
        pending, now = [task for task in self.tasks if task not in share], self.worker
        while pending:
            ready = [task for task in pending if task[1] <= now]
            if not ready:
                now = min(task[1] for task in pending)
                continue
            landed = [task for task in ready if task[2] <= now]
            task = min(landed) if landed else ready[0]
            now = max(now, task[2]) + self.c.opt_s[task[0]]
            self.updated[task[0]] = now
            pending.remove(task)
        self.worker, self.tasks = now, []

    def _share_updates(self, tasks: list[tuple[int, float, float]]) -> None:
        """The GPU update share's worker in forward order: a block's states go up once its
        gradient is held and a staging set is free (the copies back of the block `share_sets`
        before it are done: with one set, the previous block's), AdamW on the GPU, everything
        back down after it on the D2H stream."""
        c, backs = self.c, [self.share_worker]
        for order, submitted, held in tasks:
            free = backs[-c.share_sets] if len(backs) >= c.share_sets else 0.0
            self.h = max(self.h, free, submitted, held) + c.share_up_s[order]
            self.d = max(self.d, self.h) + c.share_down_s[order]
            backs.append(self.d)
            self.updated[order] = self.d
        self.share_worker = backs[-1]
