"""How a block's weights reach the device and its gradient leaves it, for one rank of a world.

World of one (`Collectives()`): a block's weights are one host-to-device copy of its copy
source, its gradient is the device accumulator itself, and the reductions are identities.

World of N (ZeRO-3 over the layer stream, store/shard.py): each rank copies its shard of the
block host -> device into its part of the destination buffer, then an all-gather
(`all_gather_into_tensor`, in place) assembles the full flat layout on every rank. Backward: a
reduce-scatter (`reduce_scatter_tensor`) of the padded fp32 accumulator leaves each rank its
shard of the gradient summed over ranks, which then goes device -> host into that rank's
optimizer (or, for a GPU-tier block, into its shard's gradient on the device; its updated
shard is then all-gathered in place into its resident weights, `gather`). Scalars (token
counts, loss sums, squared gradient norms) are all-reduced.

Ordering: every rank issues the same collectives in the same order (the engine's schedule is
the same on every rank), which NCCL and gloo require. On CUDA the all-gather runs on its own
stream after the shard's host-to-device copy, and returns an event the compute stream waits
on; the reduce-scatter runs on the compute stream (its input is the compute's output).
On the CPU (gloo) every collective completes before it returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatrain.distributed import all_gather
from megatrain.engine.transfers import DONE, Event, Transfers
from megatrain.store.blocks import ParamBlock
from megatrain.store.shard import ShardedBlock, layout_numel

# reduce_scatter_tensor under the name newer torch gives it (all_gather: distributed.py)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Collectives:
    """Block transfers and reductions for rank `rank` of `world_size` (1: this process alone)."""

    def __init__(self, transfers: Transfers, *, world_size: int = 1, rank: int = 0) -> None:
        assert world_size == 1 or dist.is_initialized(), "init the process group first"
        self.transfers = transfers
        self.world_size = world_size
        self.rank = rank
        self._stream = (
            torch.cuda.Stream(transfers.device) if transfers.is_cuda and world_size > 1 else None
        )

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def load(self, block: ParamBlock, dst: torch.Tensor, after: Event | None = None) -> Event:
        """Start filling dst[:layout_numel(block)] with the block's weights; returns the event
        the compute stream waits on before reading them."""
        if not isinstance(block, ShardedBlock):
            return self.transfers.h2d(dst[: block.numel], block.source, after=after)
        part = dst[block.shard_offset : block.shard_offset + block.numel]
        copied = self.transfers.h2d(part, block.source, after=after)
        full = dst[: block.padded_numel]
        if self._stream is None:
            all_gather(full, part)
            return DONE
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(copied)  # type: ignore[arg-type]  # sync point (GPU side)
            all_gather(full, part)
            full.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def gather(self, block: ShardedBlock, full: torch.Tensor) -> None:
        """Every rank's part of `full` (the block's whole device weights; this rank's part is
        its shard) onto every rank, in place, on the current stream (the GPU tier's refresh)."""
        part = full[block.shard_offset : block.shard_offset + block.numel]
        all_gather(full[: block.padded_numel], part)

    def reduce(
        self, block: ParamBlock, acc: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's shard of the gradient summed over ranks, from its full accumulator
        (into `out` when given: the GPU tier's own shard gradient)."""
        full = acc[: layout_numel(block)]
        if not isinstance(block, ShardedBlock):
            return full
        shard = (
            torch.empty(block.numel, dtype=full.dtype, device=full.device) if out is None else out
        )
        _reduce_scatter(shard, full)
        return shard

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over ranks (in place; returned for chaining)."""
        if self.sharded:
            dist.all_reduce(value)
        return value

    def sum_int(self, value: int) -> int:
        if not self.sharded:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._scalar_device)
        dist.all_reduce(t)
        return int(t.item())  # sync point

    @property
    def _scalar_device(self) -> torch.device:
        # NCCL reduces device tensors only; gloo host tensors.
        return self.transfers.device if self.transfers.is_cuda else torch.device("cpu")
