"""The backward half of a step: layers last to first, gradients shipped to the host updates.

A mixin of StreamingEngine (engine/engine.py), which owns every attribute declared below; it is
split out only to keep each file readable. Per layer: refill its slot (prefetched), recompute
its forward from the saved input with the forward's RNG state, `torch.autograd.grad` for the
input and parameter gradients (summed in fp32 over micro-batches), then either ship the
gradient device-to-host for the CPU AdamW or, for a GPU-tier block or one of the GPU update
share (engine/gpu_share.py), keep it on the device.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatrain.engine.boundaries import Boundaries
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.rng import restored_rng
from megatrain.engine.schedule import LOAD, RECOMPUTE, StepSchedule
from megatrain.engine.timeline import ComputeTimer
from megatrain.engine.transfers import Event
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import gradient_key, int8_views, quantize_gradient_
from megatrain.store.shard import layout_numel


class BackwardPass:
    # Owned and set up by StreamingEngine.__init__ (engine/engine.py).
    store: Any
    slots: Any
    transfers: Any
    tier: Any
    comm: Any
    device: torch.device
    dtype: torch.dtype
    aux: Any
    taps: list[Any]
    worker: Any
    share: Any
    embedder: Any
    vision: Any
    capture: Any
    max_grad_norm: float | None
    updates_begun: bool
    embed_acc: torch.Tensor
    boundaries: Boundaries
    _acc: list[torch.Tensor]
    _acc_busy: list[Event]
    _stage: list[torch.Tensor] | None
    _sumsq: list[torch.Tensor]
    _landed: dict[str, Event]
    _order: dict[str, int]
    _head_busy: list[Event]
    schedule: StepSchedule
    step_timer: ComputeTimer  # the running step's (train_step): brackets the tier's updates

    def _run_layer(
        self, i: int, module: torch.nn.Module, mb: MicroBatch, x: torch.Tensor, record: bool
    ) -> torch.Tensor:
        raise NotImplementedError  # StreamingEngine's

    def _backward(
        self, mbs: list[MicroBatch], timer: ComputeTimer, lr: float
    ) -> list[torch.Tensor]:
        plan = self.boundaries.plan
        starts = plan.starts()  # segments begin there; the backward takes them last first
        before = dict(zip(starts[1:], starts[:-1], strict=True))  # the segment visited next
        self._fetch_inputs(starts[-1], mbs, wait=False)
        for op in self.schedule.backward:  # engine/schedule.py
            i, recompute = op.layer, op.kind == RECOMPUTE
            if op.kind == LOAD:
                self.slots.load(i)
                continue
            if plan.places[i] != "none":
                self._fetch_inputs(i, mbs)  # a segment begins, or it is on the device already
                if not recompute and i in before:  # its last visit: the next input comes now,
                    self._fetch_inputs(before[i], mbs, wait=False)  # as this one's peers left
            if recompute:
                self._recompute(i, mbs, timer)
            else:
                self._backward_layer(i, mbs, timer, lr)
            self.slots.release(i)
        timer.start()
        for mb in mbs:
            self.embedder.backward(
                mb, self.store.embed.view(self.embed_acc, self.store.embed.entries[0])
            )
        timer.stop()
        self._sumsq.append(self._finish(self.store.embed, self.embed_acc, lr))
        if self.vision.trains:  # engine/vision.py: the capture again, with the vision's autograd
            timer.start()
            self.vision.backward(mbs, self.capture, self.embedder, self.transfers)
            timer.stop()
            self._sumsq.append(self._finish(self.store.vision, self.vision.grad, lr))
        return self._sumsq

    def _fetch_inputs(self, i: int, mbs: list[MicroBatch], wait: bool = True) -> None:
        """Layer i's kept inputs onto the device: started (prefetch), or ready (`wait`)."""
        for k, mb in enumerate(mbs):
            if mb.saved[i] is not None:
                continue
            if wait:
                mb.saved[i] = self.boundaries.take(k, i)
            else:
                self.boundaries.prefetch(k, i)

    def _recompute(self, i: int, mbs: list[MicroBatch], timer: ComputeTimer) -> None:
        """Re-run layer i's forward to get layer i + 1's dropped input (segment recompute)."""
        timer.start(functools.partial(self.slots.acquire, i))
        module = self.slots.modules[i]
        for mb in mbs:
            x = mb.saved[i]
            assert x is not None
            with torch.no_grad(), restored_rng(self.device, mb.rng[i] if mb.rng else None):
                mb.saved[i + 1] = self._run_layer(i, module, mb, x, record=False)
            if self.taps:
                self.taps[i].take()  # router logits of a recompute: not part of the loss
        timer.stop()

    def _backward_layer(
        self, i: int, mbs: list[MicroBatch], timer: ComputeTimer, lr: float
    ) -> None:
        block, k = self.store.layers[i], i % max(len(self._acc), 1)
        own = self.tier.owns_gradient(block)  # a one-process GPU-tier layer's own buffer
        if not own:
            self.transfers.wait(self._acc_busy[k])  # this accumulator's copy-out is done
        timer.start(functools.partial(self.slots.acquire, i))
        acc = self.tier.gradient(block) if own else self._acc[k][: layout_numel(block)].zero_()
        views = [block.view(acc, e) for e in block.entries]
        for mb in mbs:
            if self.vision.trains and mb.calls[i].after is not None:
                assert mb.grad is not None
                mb.after_grads[i] = mb.grad  # the gradient at layer i's injected output
            self._layer_backward(i, mb, views, len(mbs))
        timer.stop()
        self._sumsq.append(self._finish(block, acc, lr, k))

    def _layer_backward(
        self, i: int, mb: MicroBatch, views: list[torch.Tensor], num_micro: int
    ) -> None:
        params = self.slots.params[i]
        x = mb.saved[i]
        assert x is not None and mb.grad is not None
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), restored_rng(self.device, mb.rng[i] if mb.rng else None):
            out = self._run_layer(i, self.slots.modules[i], mb, x, record=False)
            outputs, grads = [out], [mb.grad]
            tap = self.taps[i] if self.taps else None
            if tap is not None and tap.has_router:
                assert self.aux is not None and mb.router_total is not None
                scale = self.aux.coef / (num_micro * self.comm.world_size)
                for lg in tap.take():
                    outputs.append(
                        self.aux.surrogate(lg, mb.router_weights, mb.router_total) * scale
                    )
                    grads.append(torch.ones((), device=self.device))
        result = torch.autograd.grad(outputs, [x, *params], grads, allow_unused=True)
        mb.grad, mb.saved[i] = result[0], None
        pairs = [(v, g) for v, g in zip(views, result[1:], strict=True) if g is not None]
        if pairs:
            torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])

    def _finish(
        self, block: ParamBlock, acc: torch.Tensor, lr: float, k: int | None = None
    ) -> torch.Tensor:
        """The block's gradient is complete: its squared norm (on the device). Shipped to the
        host worker, or for the GPU tier landed in its device shadow (engine/tier.py `land`;
        several ranks: its shard, reduce-scattered), and without clipping applied at once."""
        if block not in self.tier:
            return self._ship(block, acc, lr, k)
        sumsq = self.tier.land(block, acc)
        if self.max_grad_norm is None:
            self.updates_begun = True
            self._update_tier(block, lr, 1.0)
        return sumsq

    def _update_tier(self, block: ParamBlock, lr: float, coef: float) -> None:
        self.step_timer.update(
            functools.partial(
                self.tier.update, block, lr=lr, grad_scale=coef, on_gradient=self.worker.on_landed
            )
        )

    def _ship(
        self, block: ParamBlock, acc: torch.Tensor, lr: float, k: int | None = None
    ) -> torch.Tensor:
        """Copy (this rank's shard of) a block's gradient to the host; returns its squared
        norm (on the device). Several ranks: the shard of the gradient summed over ranks.
        A block of the GPU update share keeps it on the device, rounded as it would land."""
        if block in self.share:
            sumsq, held = self.share.hold(block, acc)
            self._landed[block.name] = held
            if k is not None:
                self._acc_busy[k] = held
            if self.max_grad_norm is None:
                self.updates_begun = True
                self.share.submit(block, held, order=self._order[block.name], lr=lr, grad_scale=1.0)
            return sumsq
        acc = self.comm.reduce(block, acc)
        stage = None  # fp32 compute: the fp32 gradient travels
        if self.dtype == torch.bfloat16:
            stage = (
                self._stage[k][: block.numel]
                if k is not None and self._stage is not None
                else torch.empty(block.numel, dtype=torch.bfloat16, device=self.device)
            )
        if block.grad_unit is not None:  # held as int8: the exact norm, then the codes travel
            sumsq = torch.linalg.vector_norm(acc, dtype=torch.float32).square()
            assert stage is not None
            codes, units = int8_views(stage)
            quantize_gradient_(acc, codes, units, gradient_key(block))
            self.transfers.d2h(block.grad, codes, after=self.transfers.compute_event())
            landed = self.transfers.d2h(block.grad_unit, units)  # same stream: after the codes
        else:
            if stage is not None:  # bf16 compute: the gradient travels (and lands) as bf16
                stage.copy_(acc)
            src = stage if stage is not None else acc
            sumsq = torch.linalg.vector_norm(src, dtype=torch.float32).square()
            block.take_landing()  # clipping off, bf16 master: a shared landing (may wait)
            landed = self.transfers.d2h(
                block.grad_landing, src, after=self.transfers.compute_event()
            )
        if k is not None:
            self._acc_busy[k] = landed
        else:
            self._head_busy.append(landed)
        self._landed[block.name] = landed
        if self.max_grad_norm is None:
            self.updates_begun = True
            self.worker.submit(block, landed, order=self._order[block.name], lr=lr, grad_scale=1.0)
        return sumsq
