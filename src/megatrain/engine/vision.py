"""A vision-language model's vision modules on the device: frozen, or trained like every block.

The vision tower and projector run inside the capture (model/capture.py), on every micro-batch,
from device copies (model/multimodal.py `vision_on_device`): the frozen parameters are views of
the layout's VISION buffer, filled once. Parts that train (model.freeze_vision /
freeze_projector false; the store's "vision" block, fp32 master and AdamW on the host) are bound
to VISION_TRAIN, reloaded from the block each step after its update, with an fp32 gradient in
VISION_GRAD shipped to the host like any block's.

The forward runs them without autograd (their parameters do not require grad then): keeping the
tower's activations for the whole step would cost more than the language layers'. The backward
runs them again per micro-batch, after the language layers: the capture once more with autograd
on for the vision parameters only (the embeddings detached), then one `autograd.grad` from what
the language model received of them (its first hidden states, and the injections between layers
of Qwen3-VL's deepstack) with the gradients the language layers left there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatrain.engine.layout import VISION, VISION_GRAD, VISION_TRAIN, DeviceLayout
from megatrain.engine.slots import bind_module
from megatrain.engine.transfers import DONE, Event
from megatrain.model.multimodal import vision_on_device
from megatrain.store.blocks import ParamBlock


class VisionModules:
    def __init__(
        self,
        structure: Any,
        block: ParamBlock | None,
        layout: DeviceLayout,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.block = block
        frozen = next(iter(layout.empty(VISION, device)), None)
        self.modules = vision_on_device(structure, frozen, device, dtype)
        self.weights: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.params: list[nn.Parameter] = []
        self._free: Event = DONE
        if block is None:
            return
        self.weights = next(iter(layout.empty(VISION_TRAIN, device)))
        self.grad = layout.zeros(VISION_GRAD, device)
        roots = {e.root: _submodule(self.modules, e.root) for e in block.entries}
        self.params = bind_module(roots, block, self.weights)
        self.training(False)

    def buffers(self) -> dict[str, list[torch.Tensor]]:
        """The persistent device tensors, by layout name (engine/layout.py)."""
        trained = {id(p) for p in self.params}
        frozen: list[torch.Tensor] = [
            p for m in self.modules.values() for p in m.parameters() if id(p) not in trained
        ]
        return {
            VISION: frozen,
            VISION_TRAIN: [] if self.weights is None else [self.weights],
            VISION_GRAD: [] if self.grad is None else [self.grad],
        }

    @property
    def trains(self) -> bool:
        return self.block is not None

    def training(self, on: bool) -> None:
        """Autograd through the trained parameters (the backward's recompute) or not."""
        for p in self.params:
            p.requires_grad_(on)

    def load(self, worker: Any, comm: Any, transfers: Any) -> float:
        """The trained weights onto the device, after their pending update; the seconds the
        compute waited for the optimizer."""
        if self.block is None:
            return 0.0
        waited = worker.wait(self.block)
        transfers.wait(comm.load(self.block, self.weights, self._free))
        return float(waited)

    def backward(self, mbs: list[Any], capture: Any, embedder: Any, transfers: Any) -> None:
        """Accumulate the trained parameters' gradient over the step's micro-batches (see the
        module docstring); needs each micro-batch's gradient at its first hidden state
        (`grad`, after the language layers) and at the deepstack injections (`after_grads`)."""
        assert self.grad is not None
        self.grad.zero_()
        assert self.block is not None
        views = [self.block.view(self.grad, e) for e in self.block.entries]
        self.training(True)
        try:
            for mb in mbs:
                outs, grads = self._recapture(mb, capture, embedder)
                found = torch.autograd.grad(outs, self.params, grads, allow_unused=True)
                for view, g in zip(views, found, strict=True):
                    if g is not None:
                        view.add_(g.float())
        finally:
            self.training(False)
        self._free = transfers.compute_event()  # the next load waits for these reads

    def _recapture(
        self, mb: Any, capture: Any, embedder: Any
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dev = mb.device_batch
        with torch.enable_grad():
            embeds = embedder.embeds(mb).detach()
            captured = capture.of_batch(embeds, dev)
        outs, grads = [captured.first_hidden], [mb.grad]
        for i, call in enumerate(captured.calls):
            if call.after is not None and call.after.requires_grad:
                outs.append(call.after)
                grads.append(mb.after_grads[i])
        return outs, grads


def _submodule(modules: dict[str, nn.Module], dotted: str) -> nn.Module:
    head, _, rest = dotted.partition(".")
    return modules[head].get_submodule(rest) if rest else modules[head]
