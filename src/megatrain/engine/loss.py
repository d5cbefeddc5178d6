"""The loss half of a step: final norm, lm_head and the objective through the chunked head.

A mixin of StreamingEngine (engine/engine.py), which owns every attribute declared below; it is
split out only to keep each file readable. The head's weights were started towards the device
during the forward (`_load_head`); the loss waits for them, runs every micro-batch's chunks
(forward and backward fused, engine/head.py), and ships the head's gradient. An objective with
`prepare` (a sequence-level loss) first gets every micro-batch's target log-probs from a
gradient-free pass of the head chunks, then the fused pass runs with the inputs it returns. The
MoE router aux term is the mean over every micro-batch of the step, on all ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.engine.head import TokenObjective
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.timeline import ComputeTimer
from megatrain.engine.transfers import Event
from megatrain.model.router import RouterStats


class LossPass:
    # Owned and set up by StreamingEngine.__init__ (engine/engine.py).
    store: Any
    transfers: Any
    comm: Any
    aux: Any
    loss_fn: Any
    device: torch.device
    head_params: list[Any]
    head_grad_views: list[torch.Tensor]
    head_acc: torch.Tensor
    embed_acc: torch.Tensor
    _head_ready: Event
    _head_free: Event
    _head_busy: list[Event]
    _sumsq: list[torch.Tensor]

    def _finish(
        self, block: Any, acc: torch.Tensor, lr: float, k: int | None = None
    ) -> torch.Tensor:
        raise NotImplementedError  # BackwardPass's

    def _wait_head(self, timer: ComputeTimer) -> None:
        for ev in self._head_busy:
            self.transfers.wait(ev)  # previous step's gradient copies out of the accumulators
        self._head_busy = []
        timer.start(lambda: self.transfers.wait(self._head_ready))

    def _loss(
        self,
        mbs: list[MicroBatch],
        denom: float,
        training: bool,
        timer: ComputeTimer,
        lr: float,
        objective: TokenObjective | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(loss, sum of the targets' negative log-probs, router aux term or None)."""
        self._wait_head(timer)
        if training:
            self.head_acc.zero_()
            self.embed_acc.zero_()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        nll = torch.zeros((), dtype=torch.float32, device=self.device)
        inputs = None if objective is None else objective.inputs
        if objective is not None and objective.prepare is not None:
            extra, value = objective.prepare(self._label_logprobs(mbs, objective.temperature))
            inputs = [{**a, **b} for a, b in zip(objective.inputs, extra, strict=True)]
            total += value.to(self.device)
        for k, mb in enumerate(mbs):
            side = None
            if inputs is not None:
                side = {n: _shifted(t) for n, t in inputs[k].items()}
            loss, mb_nll, mb.grad = self.loss_fn.run(
                mb.hidden,
                mb.targets_BS,
                denom,
                self.head_params if training else None,
                self.head_grad_views if training else None,
                fn=None if objective is None else objective.fn,
                side_host_BS=side,
                temperature=1.0 if objective is None else objective.temperature,
            )
            total += loss
            nll += mb_nll
            mb.hidden = None  # type: ignore[assignment]
        timer.stop()
        self._head_free = self.transfers.compute_event()
        aux = self._aux_value(mbs)
        if training:
            self._sumsq = [self._finish(self.store.head, self.head_acc, lr)]
        return total, nll, aux

    def _label_logprobs(self, mbs: list[MicroBatch], temperature: float) -> list[torch.Tensor]:
        """Per micro-batch, host fp32 [B, S]: the log-prob of each supervised label (0 elsewhere),
        label-aligned; the head's forward only (a sync point per micro-batch: copy to the host)."""
        out = []
        for mb in mbs:
            shifted = self.loss_fn.logprobs(mb.hidden, mb.targets_BS, temperature)
            logp = torch.zeros_like(shifted)
            logp[:, 1:] = shifted[:, :-1]  # position t + 1's label is predicted at t
            out.append(logp)
        return out

    def _aux_value(self, mbs: list[MicroBatch]) -> torch.Tensor | None:
        if self.aux is None:
            return None
        values = []
        for mb in mbs:
            mb.router_total = RouterStats.sum(mb.router_stats)
            values.append(self.aux.value(mb.router_total))
        # the mean over every micro-batch of the step, on all ranks (each has as many)
        total = self.comm.sum(torch.stack(values).sum())
        return self.aux.coef * total / (len(values) * self.comm.world_size)


def _shifted(values_BS: torch.Tensor) -> torch.Tensor:
    """Label-aligned per-token values moved to target alignment (position t predicts t + 1)."""
    out = torch.zeros_like(values_BS)
    out[:, :-1] = values_BS[:, 1:]
    return out
