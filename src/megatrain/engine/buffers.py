"""The engine's persistent device buffers: the head's and the embedding's, and the list of all.

A mixin of StreamingEngine (engine/engine.py), which owns every attribute declared below; it is
split out only to keep each file readable. `_build_head` sets up the final norm and lm_head on
the device and the head's and embedding's weights and fp32 gradients: a GPU-tier block brings
its own weights (engine/tier.py), and its own fp32 gradient in fp32 compute on one rank; any
other takes the `DeviceLayout`'s buffers (engine/layout.py).
`device_buffers` lists every persistent device tensor the engine holds by layout name, which
tests compare with the layout the planner sums.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.engine.head import ChunkedLoss
from megatrain.engine.layout import (
    ACCUMULATORS,
    EMBED_GRAD,
    GATHERED,
    HEAD,
    HEAD_GRAD,
    SHARE_GRADS,
    SHARE_STAGING,
    SLOTS,
    STAGING,
    TABLE,
    TIER,
    DeviceLayout,
)
from megatrain.engine.slots import bind_module, device_copy
from megatrain.engine.transfers import DONE, Event
from megatrain.store.blocks import ParamBlock


class DeviceBuffers:
    # Owned and set up by StreamingEngine.__init__ (engine/engine.py).
    structure: Any
    store: Any
    layout: DeviceLayout
    device: torch.device
    dtype: torch.dtype
    tier: Any
    slots: Any
    vision: Any
    share: Any
    _acc: list[torch.Tensor]
    _stage: list[torch.Tensor] | None

    def _build_head(self, loss_chunk_tokens: int) -> None:
        st, store, layout = self.structure, self.store, self.layout
        self.norm = device_copy(st.final_norm, self.device)
        self.lm_head = device_copy(st.lm_head, self.device)
        # GPU-tier blocks bring their own device weights (and fp32 gradient: `owns_gradient`)
        self.head_buf, self.head_acc = self._device_buffers(store.head, HEAD, HEAD_GRAD)
        self.head_params = bind_module(
            {"norm": self.norm, "lm_head": self.lm_head}, store.head, self.head_buf
        )
        self.table_buf, self.embed_acc = self._device_buffers(store.embed, TABLE, EMBED_GRAD)
        self.head_grad_views = [store.head.view(self.head_acc, e) for e in store.head.entries]
        if st.tied:  # the lm_head is the embedding table: it goes to the GPU whole for the loss
            self.head_params += bind_module({"embed": self.lm_head}, store.embed, self.table_buf)
            self.head_grad_views.append(store.embed.view(self.embed_acc, store.embed.entries[0]))
        # Sharded: no host holds the whole embedding table; it is gathered on the device
        # (unless it is resident: the GPU tier's).
        self.embed_buf = next(iter(layout.empty(GATHERED, self.device)), None)
        self._embed_free: Event = DONE
        self.loss_fn = ChunkedLoss(st, self.norm, self.lm_head, loss_chunk_tokens)
        self._head_ready: Event = DONE
        self._head_free: Event = DONE
        self._head_busy: list[Event] = []

    def _device_buffers(
        self, block: ParamBlock, weights: str, grad: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(compute-dtype weights, fp32 gradient) of a head or embedding block on the device:
        the GPU tier's where it has them, else the layout's buffers `weights` and `grad` (an
        empty weights tensor where the plan needs none: an untied embedding)."""
        layout = self.layout
        if block in self.tier:
            weights_t = self.tier.weights(block)
        else:
            weights_t = next(iter(layout.empty(weights, self.device)), None)
            if weights_t is None:
                weights_t = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.tier.owns_gradient(block):
            assert block.grad is not None
            return weights_t, block.grad
        grad_t = layout.zeros(grad, self.device)
        assert grad_t is not None
        return weights_t, grad_t

    def device_buffers(self) -> dict[str, list[torch.Tensor]]:
        """The persistent device tensors this engine holds, by layout name (engine/layout.py);
        a GPU-tier block's by its states (tests compare them with the layout)."""
        tier: list[torch.Tensor] = []
        for block in self.tier.blocks:  # whole weights first: the shard's may be views of them
            parts = (block.master, block.shadow, *block.state_tensors().values(), block.grad)
            tier += [self.tier.weights(block), *(t for t in parts if t is not None)]
        return {
            SLOTS: list(self.slots.buffers),
            ACCUMULATORS: list(self._acc),
            STAGING: list(self._stage or []),
            HEAD: [] if self.store.head in self.tier else [self.head_buf],
            TABLE: [] if self.store.embed in self.tier else [self.table_buf],
            HEAD_GRAD: [] if self.tier.owns_gradient(self.store.head) else [self.head_acc],
            EMBED_GRAD: [] if self.tier.owns_gradient(self.store.embed) else [self.embed_acc],
            GATHERED: [] if self.embed_buf is None else [self.embed_buf],
            **self.vision.buffers(),
            TIER: _distinct(tier),
            SHARE_GRADS: [t for t in (self.share.grads,) if t is not None],
            SHARE_STAGING: list(self.share.staging),
        }


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each storage once (a tier block's weights may be its master, or hold its shard's)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(t)
    return out
