"""The GPU tier of optimizer states: the first blocks keep everything on the device.

Tier order: decoder layers 0, 1, ..., L-1, then the embedding, then the head; the tier is the
first `count` blocks of it (`memory.gpu_state_blocks`). A tier block's fp32 master, AdamW m and
v and its compute-dtype weights (the bf16 shadow, or the master itself in fp32 compute) live on
the device for the whole run (`ParamBlock.to_device`). A tier layer's module is bound to those
weights once (engine/slots.py: resident layers), so it is never streamed.

Gradient (`land`): a tier block's gradient waits for its update where a host block's does, in
its bf16 shadow: its weights are not read again before the update rewrites them (a layer's
backward is its last use in the step; the head's and the table's, the loss's). It accumulates
in fp32 as a streamed block's does (the engine's shared accumulators, or the head's and the
embedding's fp32 buffers), is rounded into the shadow as the host landing rounds it, and its
squared norm is taken of that rounding as `_ship` takes it. So a tier block costs 4 B/param less
than with a gradient buffer of its own, and its update (`update`: `CpuAdamW.update_device`, the
fused kernel, bit for bit the C kernel, with the same decay range, clipping coefficient and
rounding keys) computes what the host worker's would: the losses do not depend on the tier's
size (tests/engine/test_gpu_tier.py). fp32 compute has no shadow: a tier block there keeps an
fp32 gradient (one process accumulates straight into it; a shard receives its reduce-scatter).
A step undone before its updates (recipes/oom.py) rebuilds every shadow from its master.

Several ranks (store/shard.py): a tier block is this rank's shard, so its fp32 master, m and v
are 1/world of the block, on this rank's GPU; the whole block's compute-dtype weights are
resident on every GPU (`weights`), and the shard's weights (bf16 shadow, or fp32 master) are a
view of this rank's part of them. Backward: the block's gradient, accumulated in the engine's
shared fp32 accumulator, is reduce-scattered into this rank's shard, which lands in the shard's
shadow (`land`; the other parts of the whole weights are stale until the update's all-gather);
the update runs on the shard, in place in the resident weights, and an in-place all-gather
(`Collectives.gather`) brings every rank's updated part to every GPU, on the compute stream.

Why this order: the layers in forward order are the ones the next forward would wait for first
on the host path. With clipping, host updates start after the whole backward, in forward order,
so the forward stalls on layer 0's update at once; without clipping, gradients land last layer
first, so layer 0's update is the last to finish. Taking layers 0..k-1 off the host lets the
next forward run k layers while the host worker updates the rest. The embedding (waited for
first too, at the forward's start) and the head come after all layers: each is one V x D block
(a 151k x 2048 table is as large as 4 Qwen2.5-3B layers), so they join once every layer fits;
then nothing is left for the CPU and the step runs at GPU speed. A tier embedding gathers its
rows on the device (engine/microbatch.py); a tier head or tied table is bound, not copied.

Invariants: a tier block never goes through the host update worker; its update (and, with
ranks, its all-gather) is queued on the compute stream, so the next use of its weights is
ordered after it without an event; every rank has the same tier (the builder agrees on one
count) and updates its blocks in the same order, so the collectives match; the checkpoint
files of a tier block are those of a host block (checkpoint/saving.py copies them over); after a
checkpoint load into a sharded tier, `refresh()` gathers the loaded shards again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatrain.engine.collectives import Collectives
from megatrain.engine.plan import tier_order
from megatrain.optim.adamw import DEVICE_CHUNK, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.shard import ShardedBlock


class GpuTier:
    """The blocks whose optimizer states live on the compute device, and their updates."""

    @classmethod
    def first_blocks(
        cls, store: HostStore, count: int, optimizer: CpuAdamW, comm: Collectives
    ) -> GpuTier:
        """The first `count` blocks of the tier order (layers, embedding, head)."""
        order = tier_order(store.layers, store.embed, store.head)
        assert 0 <= count <= len(order), count  # the plan clamps it
        return cls(order[:count], optimizer, comm)

    def __init__(
        self, blocks: Sequence[ParamBlock], optimizer: CpuAdamW, comm: Collectives
    ) -> None:
        self.blocks = list(blocks)
        self.optimizer = optimizer
        self.comm = comm
        self._weights: dict[str, torch.Tensor] = {}
        for block in self.blocks:
            block.to_device(comm.transfers.device)
            self._weights[block.name] = self._resident(block)
        self.num_layers = sum(b.name.startswith("layer.") for b in self.blocks)

    def _resident(self, block: ParamBlock) -> torch.Tensor:
        """The whole block's compute-dtype weights on the device; for a shard, its own weights
        become a view of its part of them, filled from every rank by an all-gather."""
        if not isinstance(block, ShardedBlock):
            return block.source
        full = torch.zeros(block.padded_numel, dtype=block.source.dtype, device=block.master.device)
        part = full[block.shard_offset : block.shard_offset + block.numel]
        part.copy_(block.source)
        if block.shadow is not None:
            block.shadow = part
        else:  # fp32 compute: the master is the weights
            block.master = part
        self.comm.gather(block, full)
        return full

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block: ParamBlock) -> bool:
        return block.name in self._weights

    def weights(self, block: ParamBlock) -> torch.Tensor:
        """The block's whole flat weights in the compute dtype, on the device for the run."""
        return self._weights[block.name]

    def own_weights(self, block: ParamBlock) -> torch.Tensor:
        """The part of the block's device weights this process writes: all of them, or (a
        shard) this rank's part, a view of them that the all-gather spreads (`rewrite`)."""
        if not isinstance(block, ShardedBlock):
            return self.weights(block)
        return block.shadow if block.shadow is not None else block.master

    def rewrite(self, block: ParamBlock, source: torch.Tensor) -> None:
        """Overwrite the block's device weights with `source` (what `own_weights` holds: its
        whole weights, or this rank's part of them), then, sharded, all-gather every rank's
        part; queued on the current stream (a reference pass swaps its weights in and out)."""
        self.own_weights(block).copy_(source, non_blocking=True)
        if isinstance(block, ShardedBlock):
            self.comm.gather(block, self._weights[block.name])

    def owns_gradient(self, block: ParamBlock) -> bool:
        """Whether the block's gradient accumulates in its own device buffer: fp32 compute,
        one process. Any other's accumulates where a streamed block's does ("Gradient")."""
        return block in self and block.shadow is None and not isinstance(block, ShardedBlock)

    def gradient(self, block: ParamBlock) -> torch.Tensor:
        """The block's fp32 device gradient buffer, zeroed for a new step's accumulation."""
        assert block.grad is not None and self.owns_gradient(block)
        return block.grad.zero_()

    def land(self, block: ParamBlock, acc: torch.Tensor) -> torch.Tensor:
        """The block's complete fp32 accumulator `acc` (sharded: summed over ranks, this rank's
        shard) where its update reads it: rounded into its bf16 shadow, or (fp32 compute) its
        fp32 gradient; returns the squared norm of what landed (on the device)."""
        grad = self.comm.reduce(block, acc, out=block.grad)
        if block.shadow is not None:
            block.shadow.copy_(grad)
            grad = block.shadow
        return torch.linalg.vector_norm(grad, dtype=torch.float32).square()

    def update(
        self,
        block: ParamBlock,
        *,
        lr: float,
        grad_scale: float,
        on_gradient: Callable[[ParamBlock], None] | None = None,
    ) -> None:
        """AdamW on the device, queued on the current (compute) stream; rewrites the weights
        (sharded: this rank's part, then the all-gather of every part).

        `on_gradient`: called first, with the final gradient in place (verify's snapshot).
        """
        if on_gradient is not None:
            on_gradient(block)
        self.optimizer.update_device(block, lr=lr, grad_scale=grad_scale, chunk=DEVICE_CHUNK)
        if isinstance(block, ShardedBlock):
            self.comm.gather(block, self._weights[block.name])

    def refresh(self) -> None:
        """Gather every sharded block's weights again (its shard was loaded from a checkpoint)."""
        for block in self.blocks:
            if isinstance(block, ShardedBlock):
                self.comm.gather(block, self._weights[block.name])
