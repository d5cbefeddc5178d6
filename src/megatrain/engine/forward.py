"""The step's forward pass (a part of StreamingEngine, engine/engine.py).

Embedding rows gathered per micro-batch; then for each layer i: wait for its weights, run it
over every micro-batch, keep its input for the backward (engine/boundaries.py). Layers stream
into the device slots, the next ones copied while this one computes; the head's weights are
loaded as the last layer's are. A layer holding a router records its logits for the aux loss.

Invariants: a block is copied to the device only after its pending update (host worker or GPU
update share) is applied (`wait_update`); a slot is reused only after the compute stream is
done with it (`release`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatrain.batch import Batch
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.rng import rng_state
from megatrain.engine.schedule import LOAD, LOAD_HEAD, StepSchedule
from megatrain.engine.timeline import ComputeTimer, Timeline
from megatrain.engine.transfers import Event


class ForwardPass:
    # Owned and set up by StreamingEngine.__init__ (engine/engine.py).
    store: Any
    slots: Any
    transfers: Any
    tier: Any
    comm: Any
    device: torch.device
    aux: Any
    taps: list[Any]
    worker: Any
    structure: Any
    embedder: Any
    capture: Any
    vision: Any
    boundaries: Any
    head_buf: torch.Tensor
    table_buf: torch.Tensor
    embed_buf: torch.Tensor | None
    _embed_free: Event
    _head_ready: Event
    _head_free: Event
    _preserve_rng: bool
    schedule: StepSchedule

    def wait_update(self, block: Any) -> float:
        raise NotImplementedError  # StreamingEngine's

    def _forward(
        self, batches: list[Batch], training: bool, timeline: Timeline, timer: ComputeTimer
    ) -> list[MicroBatch]:
        timeline.wait_optimizer_s += self.wait_update(self.store.embed)
        if self.embed_buf is not None:  # sharded: gather the table (sync point: compute waits)
            self.transfers.wait(self.comm.load(self.store.embed, self.embed_buf, self._embed_free))
            self.embedder.device_table = self.store.embed.view(
                self.embed_buf, self.store.embed.entries[0]
            )
        timeline.wait_optimizer_s += self.vision.load(self.worker, self.comm, self.transfers)
        keep = training and self.vision.trains
        mbs = [
            self.embedder.start(b, self.capture, training, self.aux is not None, keep)
            for b in batches
        ]
        self._embed_free = self.transfers.compute_event()
        for op in self.schedule.forward:  # engine/schedule.py
            if op.kind == LOAD:
                self._load_layer(op.layer, timeline)
            elif op.kind == LOAD_HEAD:
                self._load_head(timeline)
            else:
                self._forward_layer(op.layer, mbs, training, timer)
        return mbs

    def _forward_layer(
        self, i: int, mbs: list[MicroBatch], training: bool, timer: ComputeTimer
    ) -> None:
        timer.start(functools.partial(self.slots.acquire, i))
        module = self.slots.modules[i]
        for k, mb in enumerate(mbs):  # inputs kept for the backward only
            mb.saved.append(self.boundaries.save(k, i, mb.hidden) if training else None)
            if self._preserve_rng:
                mb.rng.append(rng_state(self.device))
            with torch.no_grad():
                mb.hidden = self._run_layer(i, module, mb, mb.hidden, record=True)
        timer.stop()
        self.slots.release(i)

    def _load_layer(self, i: int, timeline: Timeline) -> None:
        timeline.wait_optimizer_s += self.wait_update(self.store.layers[i])
        self.slots.load(i)

    def _load_head(self, timeline: Timeline) -> None:
        if self.store.head not in self.tier:
            timeline.wait_optimizer_s += self.wait_update(self.store.head)
            self._head_ready = self.comm.load(self.store.head, self.head_buf, self._head_free)
        if self.structure.tied and self.store.embed not in self.tier:
            timeline.wait_optimizer_s += self.wait_update(self.store.embed)
            self.transfers.wait(self._head_ready)
            self._head_ready = self.comm.load(self.store.embed, self.table_buf, self._head_free)

    def _run_layer(
        self, i: int, module: torch.nn.Module, mb: MicroBatch, x: torch.Tensor, record: bool
    ) -> torch.Tensor:
        tap = self.taps[i] if self.taps else None
        if tap is not None and tap.has_router:
            tap.armed = True
        try:
            out = mb.calls[i].run(module, x)
        finally:
            if tap is not None:
                tap.armed = False
        if tap is not None and tap.has_router and record:
            assert self.aux is not None
            mb.router_stats += [self.aux.stats(lg, mb.router_weights) for lg in tap.take()]
        return out
