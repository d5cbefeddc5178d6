"""The GPU tier of optimizer states: the first blocks keep everything on the device.

Tier order: decoder layers 0, 1, ..., L-1, then the embedding, then the head; the tier is the
first `count` blocks of it (`memory.gpu_state_blocks`). A tier block's fp32 master, AdamW m and
v, an fp32 gradient and its compute-dtype weights (the bf16 shadow, or the master itself in
fp32 compute) live on the device for the whole run (`ParamBlock.to_device`). A tier layer's
module is bound to those weights once (engine/slots.py: resident layers), so it is never
streamed; its gradient accumulates straight into its own buffer (no device-to-host copy); its
update is the same AdamW (`CpuAdamW.update(on_device=True)`: torch's fused kernel, on the
device) with the same decay range and clipping coefficient.

Why this order: the layers in forward order are the ones the next forward would wait for first
on the host path. With clipping, host updates start after the whole backward, in forward order,
so the forward stalls on layer 0's update at once; without clipping, gradients land last layer
first, so layer 0's update is the last to finish. Taking layers 0..k-1 off the host lets the
next forward run k layers while the host worker updates the rest. The embedding (waited for
first too, at the forward's start) and the head come after all layers: each is one V x D block
(a 151k x 2048 table is as large as 4 Qwen2.5-3B layers), so they join once every layer fits;
then nothing is left for the CPU and the step runs at GPU speed. A tier embedding gathers its
rows on the device (engine/microbatch.py); a tier head or tied table is bound, not copied.

Invariants: a tier block never goes through the host update worker; its update is queued on
the compute stream, so the next use of its weights is ordered after it without an event; the
checkpoint files of a tier block are those of a host block (checkpoint.py copies them over).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatrain.optim.adamw import CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore


class GpuTier:
    """The blocks whose optimizer states live on the compute device, and their updates."""

    @classmethod
    def first_blocks(
        cls, store: HostStore, count: int, optimizer: CpuAdamW, device: torch.device
    ) -> GpuTier:
        """The first `count` blocks of the tier order (layers, embedding, head)."""
        assert 0 <= count <= len(store.layers) + 2, count  # the plan clamps it
        return cls([*store.layers, store.embed, store.head][:count], optimizer, device)

    def __init__(
        self, blocks: Sequence[ParamBlock], optimizer: CpuAdamW, device: torch.device
    ) -> None:
        self.blocks = list(blocks)
        self.optimizer = optimizer
        for block in self.blocks:
            block.to_device(device)
        self._names = {b.name for b in self.blocks}
        self.num_layers = sum(b.name.startswith("layer.") for b in self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block: ParamBlock) -> bool:
        return block.name in self._names

    def gradient(self, block: ParamBlock) -> torch.Tensor:
        """The block's fp32 device gradient buffer, zeroed for a new step's accumulation."""
        assert block.grad is not None and block in self
        return block.grad.zero_()

    def update(
        self,
        block: ParamBlock,
        *,
        lr: float,
        grad_scale: float,
        on_gradient: Callable[[ParamBlock], None] | None = None,
    ) -> None:
        """AdamW on the device, queued on the current (compute) stream; rewrites the weights.

        `on_gradient`: called first, with the final gradient in place (verify's snapshot).
        """
        if on_gradient is not None:
            on_gradient(block)
        self.optimizer.update(block, lr=lr, grad_scale=grad_scale, on_device=True)
