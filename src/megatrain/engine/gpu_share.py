"""A planned share of the streamed blocks' AdamW updates, run on the GPU.

`optimizer.gpu_update_blocks` = N: the last N streamed blocks in forward order (the head, then
the last layers: `share_order`; never a GPU-tier block, never the embedding) are updated on the
compute device instead of by the host worker. With clipping, the host worker updates blocks in
forward order once the global norm is known, and the next forward waits for each; the share is
what it would reach last, so the CPU and the GPU update at the same time and both are done
before the next forward needs their blocks.

Per share block and step:
1. Backward (`hold`): its gradient never leaves the device. The fp32 accumulator is rounded
   exactly as the host landing would hold it (store/grads.py HOLDS: a bf16 copy for an fp32
   master's shadow, a bf16 master's bf16 or pool landing; int8 codes and units quantized with
   the same key; fp32 in fp32 compute) into the block's own device buffer; its squared norm is
   taken as `_ship` takes it, so the global norm is unchanged.
2. Update (`update`, on a second host worker thread, engine/updates.py): the block's master and
   AdamW states, as stored, are copied host-to-device into the staging set (the largest share
   block's size), AdamW runs there (`CpuAdamW.update_device`: the fused Triton kernel of
   optim/triton_adamw.py where it takes the formats, as the GPU tier, else the torch reference
   of the C kernels; either with the same StepScalars, stochastic-rounding keys and clipping
   coefficient, bit for bit the host update), and master, states and the new weights (the bf16
   shadow, or the master that is the streamed copy) are copied back device-to-host. Copies in
   and the AdamW run on one stream, copies back on another; a staging set's next block's copies
   in wait for them (the plan's `share_sets` sets, taken in turn: "Staging sets" below). The
   share's master and states are page-locked where they lie in the store (store/memory.py
   `pin_in_place`, at start; the small scales moved to pinned memory): every copy runs at the
   link's pinned rate and is queued without waiting.
3. The next forward's copy of the block waits for it as for a host update (`wait(block)`).

Device memory (engine/layout.py SHARE_GRADS, SHARE_STAGING): every share block's held gradient
(2 B/param bf16, 1.002 int8, 4 fp32) for the whole run, and each staging set of master +
states (+ the bf16 shadow written by the update). The torch reference's temporaries, up to
WORK_BYTES, are freed after each pass of DEVICE_CHUNK values and kept by the allocator: the
estimate counts them beside the layout.

Invariants: a staging set takes a block only after its previous block's copies back are done
(the up stream waits for them); an update starts only after its held gradient is written (the
landed event), and its copies back are complete (synchronized) before `wait(block)` returns,
so the next forward's host-to-device copy and the next backward's write of the held gradient
come after it; under ranks there is no share (the planner refuses N > 0 there).

Staging sets (EnginePlan.share_sets, choices.py STAGING_SET_CHOICES): with one set each
block's states go up only after the previous block's came back; with two, one block's go up
while the previous one's come back (the link's two directions at once), for a second set of
staging memory. Two until run 72, when they gave NaN losses sooner than one; the NaN was a race
of the embedding rows' copy, which the share's load on the GPU exposed, fixed in run 76
(docs/optimizer_states.md, "The share's NaN"). Two sets ran 12 steps clean since (run 77,
GPT-OSS-20B at 17 layers, int8, an H200: a 1.7% shorter step than one); the planner picks
the count of the shorter predicted step since run 80 (planning/replay.py replays either).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from megatrain.engine.plan import TierSplit
from megatrain.engine.transfers import Event, Transfers
from megatrain.engine.updates import UpdateWorker
from megatrain.optim import triton_adamw
from megatrain.optim.adamw import DEVICE_CHUNK, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import gradient_key, num_grad_blocks, quantize_gradient_
from megatrain.store.int4 import INT4_HALF, num_int4_blocks
from megatrain.store.memory import pin_in_place, pinnable
from megatrain.store.states import num_quant_blocks

T = TypeVar("T")

ALIGN = 256
"""Byte alignment of each tensor carved out of a share buffer."""
WORK_BYTES_PER_VALUE = 81
"""Peak bytes of the reference update's temporaries per value of a pass, the most of any format
(a bf16 master or bf16 states: the stochastic rounding's int64 indices and hashes; fp32 states
28, int8 38): counted on the CPU (2026-11-28, a TorchDispatchMode tracking every op's new
storages until freed, over `CpuAdamW.update_reference` on a 1M-value block in one pass)."""
WORK_BYTES = DEVICE_CHUNK * WORK_BYTES_PER_VALUE
"""GPU memory the torch reference's update allocates beside its buffers (its stream's pool
keeps it), 680 MB: planning/estimate.py counts it (`work_bytes`) for a share or a GPU tier of
formats the fused kernel does not take."""
REFERENCE_ONLY = False
"""True: the share updates through the torch reference, never the fused Triton kernel (a
diagnostic lever: bench/share_diag sets it). The share took the reference from run 66 to run
71 while its NaN was searched for (docs/performance.md): the fused kernel's results equal the C
kernel's bit for bit (tests/optim/test_triton_adamw.py; run 70's `verify` over real updates),
and the NaN, which came with either, was the embedding's race ("Staging sets" above)."""
Parts = list[tuple[torch.dtype, int]]


def runs_fused(formats: BlockFormats, *, share: bool) -> bool:
    """Whether a device update of blocks of `formats` runs the fused Triton kernel: where it
    takes the formats, for a GPU tier block always, for a share block unless REFERENCE_ONLY."""
    takes = triton_adamw.takes(formats.master_dtype, formats.state_dtype)
    return takes and not (share and REFERENCE_ONLY)


def work_bytes(formats: BlockFormats, *, share: bool) -> int:
    """GPU bytes a device update allocates beside its buffers: the torch reference's
    temporaries; none where it `runs_fused`."""
    return 0 if runs_fused(formats, share=share) else WORK_BYTES


def share_of(layers: Sequence[T], head: T, streamed: Callable[[T], bool], count: int) -> list[T]:
    """The share's `count` blocks (fewer if fewer stream), first to last: the head, then the
    layers from the last (what the host worker reaches last in forward order), skipping those
    not `streamed` (the GPU tier's). `T`: a block, or what the planner knows of one."""
    return [b for b in [head, *reversed(layers)] if streamed(b)][:count]


def share_size(num_layers: int, tier: TierSplit, count: int) -> int:
    """How many blocks a share of `count` holds beside `tier`: at most the streamed layers and
    a streamed head."""
    return min(count, num_layers - tier.layers + (not tier.head))


def staging_sets(sets: int, blocks: int) -> int:
    """The staging sets a share of `blocks` blocks takes of `sets`: one where it holds fewer
    than two (a second set would stay unused: EnginePlan.share_sets)."""
    return sets if blocks > 1 else 1


@dataclass(frozen=True)
class BlockFormats:
    """How the store keeps a block: master and state dtypes, where its gradient is held
    (store/grads.py HOLDS), and whether it has a bf16 shadow (fp32 master, bf16 compute)."""

    master_dtype: str = "fp32"
    state_dtype: str = "fp32"
    hold: str = "shadow"

    @property
    def shadow(self) -> bool:
        return self.hold == "shadow"

    def gradient_parts(self, numel: int) -> Parts:
        """The held gradient on the device, as the host landing would hold it."""
        if self.hold == "fp32":
            return [(torch.float32, numel)]
        if self.hold == "int8":
            return [(torch.int8, numel), (torch.float32, num_grad_blocks(numel))]
        return [(torch.bfloat16, numel)]

    def staging_parts(self, numel: int) -> Parts:
        """Master, m, v (and their scales), then the shadow: the update's device copy."""
        master = torch.bfloat16 if self.master_dtype == "bf16" else torch.float32
        states: Parts
        if self.state_dtype in ("fp32", "bf16"):
            dtype = torch.float32 if self.state_dtype == "fp32" else torch.bfloat16
            states = [(dtype, numel), (dtype, numel)]
        else:
            codes, scales = (
                (INT4_HALF * num_int4_blocks(numel), num_int4_blocks(numel))
                if self.state_dtype == "int4"
                else (numel, num_quant_blocks(numel))
            )
            states = [(torch.uint8, codes), (torch.uint8, codes)]
            states += [(torch.float32, scales), (torch.float32, scales)]
        shadow: Parts = [(torch.bfloat16, numel)] if self.shadow else []
        return [(master, numel), *states, *shadow]


def packed_bytes(parts: Parts) -> int:
    """Bytes of one buffer holding `parts`, each starting ALIGN-aligned."""
    return sum(_aligned(n * d.itemsize) for d, n in parts)


def carve(buffer: torch.Tensor, parts: Parts) -> list[torch.Tensor]:
    """Views of a uint8 `buffer` with `parts`' dtypes and lengths (as `packed_bytes` packs)."""
    out, at = [], 0
    for dtype, n in parts:
        out.append(buffer[at : at + n * dtype.itemsize].view(dtype))
        at += _aligned(n * dtype.itemsize)
    assert at <= buffer.numel(), (at, buffer.numel())
    return out


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class GpuShare:
    """The share's blocks, their held device gradients, and the worker that updates them."""

    def __init__(
        self,
        blocks: Sequence[ParamBlock],
        formats: BlockFormats,
        optimizer: CpuAdamW,
        transfers: Transfers,
        *,
        grads: torch.Tensor | None,
        staging: Sequence[torch.Tensor],
        threaded: bool = True,
    ) -> None:
        self.blocks = list(blocks)
        self.formats = formats
        self.optimizer = optimizer
        self.transfers = transfers
        self.grads, self.staging = grads, list(staging)
        self._held: dict[str, list[torch.Tensor]] = {}
        at = 0
        for block in self.blocks:
            assert grads is not None and self.staging
            parts = formats.gradient_parts(block.numel)
            self._held[block.name] = carve(grads[at : at + packed_bytes(parts)], parts)
            at += packed_bytes(parts)
        cuda = transfers.is_cuda
        # up: copies in and the AdamW; down: copies back (the link's two directions)
        self._up = torch.cuda.Stream(transfers.device) if cuda else None
        self._down = torch.cuda.Stream(transfers.device) if cuda else None
        self._turn = 0  # the staging set the next update takes
        self._free: list[Any] = [None] * len(self.staging)  # each set's last copies back
        self._back: dict[str, Any] = {}  # block name -> its copies back (CUDA events)
        self._began: dict[str, Any] = {}  # block name -> its start on the up stream
        # waited blocks' (start, back) events, in the up stream's order: the first is earliest
        self._spans: list[tuple[int, Any, Any]] = []
        self._issued = 0
        pageable = sum(_pin(block) for block in self.blocks) if transfers.is_cuda else 0
        if pageable:
            print(
                f"GPU update share: {pageable / 2**30:.1f} GiB of its host tensors could not be "
                "page-locked where they lie (not page-aligned, or refused by cudaHostRegister): "
                "their copies run at the pageable rate and wait for the stream's earlier work; "
                "set optimizer.gpu_update_blocks: 0 if the step is slower than without the share",
                flush=True,
            )
        # called with the device block once its gradient is in place, before its update
        # (verify's snapshot: the engine passes the host worker's `on_landed`)
        self.on_gradient: Callable[[ParamBlock], None] | None = None
        # duck-typed: the worker calls `update(block, lr=, grad_scale=)` on its thread
        self.worker = UpdateWorker(self, threaded=threaded and bool(self.blocks))  # type: ignore[arg-type]

    def __contains__(self, block: ParamBlock) -> bool:
        return block.name in self._held

    def hold(self, block: ParamBlock, acc: torch.Tensor) -> tuple[torch.Tensor, Event]:
        """Keep a complete fp32 gradient `acc` on the device, rounded as the host landing would
        hold it; (its squared norm as `_ship` takes it, the event marking it written)."""
        held = self._held[block.name]
        if self.formats.hold == "int8":  # the exact norm, then the codes (as `_ship`)
            sumsq = torch.linalg.vector_norm(acc, dtype=torch.float32).square()
            quantize_gradient_(acc, held[0], held[1], gradient_key(block))
        else:
            held[0].copy_(acc)
            src = acc if self.formats.hold == "fp32" else held[0]
            sumsq = torch.linalg.vector_norm(src, dtype=torch.float32).square()
        return sumsq, self.transfers.compute_event()

    def submit(
        self, block: ParamBlock, landed: Event, *, order: int, lr: float, grad_scale: float
    ) -> None:
        """Queue the block's update once `landed` (its held gradient written) is done."""
        self.worker.submit(block, landed, order=order, lr=lr, grad_scale=grad_scale)

    def update(self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0) -> None:
        """The block's AdamW on the device (the worker thread calls it once its held gradient
        is written): states in, the update, master, states and weights out. On CUDA it
        returns once queued: the copies in and the AdamW on the up stream, after the copies
        back of the staging set's previous block ("Staging sets" above); the copies back on
        the down stream. `wait` waits for them."""
        turn, up, down = self._turn, self._up, self._down
        self._turn = (turn + 1) % len(self.staging)
        if up is None or down is None:  # the CPU: in order, done on return
            device = self._device_block(block, self.staging[turn])
            self._apply(device, lr, grad_scale)
            for name, host in _host_tensors(block).items():
                host.copy_(getattr(device, name))
            block.step = device.step
            return
        with torch.cuda.stream(up):
            if self._free[turn] is not None:
                up.wait_event(self._free[turn])  # the set's previous block is back on the host
            began = torch.cuda.Event(enable_timing=True)
            began.record(up)
            device = self._device_block(block, self.staging[turn])
            self._apply(device, lr, grad_scale)
            computed = torch.cuda.Event()
            computed.record(up)
        with torch.cuda.stream(down):
            down.wait_event(computed)
            for name, host in _host_tensors(block).items():
                host.copy_(getattr(device, name), non_blocking=True)
            back = torch.cuda.Event(enable_timing=True)
            back.record(down)
        self._free[turn] = self._back[block.name] = back
        self._began[block.name] = (self._issued, began)
        self._issued += 1
        block.step = device.step

    def _apply(self, device: ParamBlock, lr: float, grad_scale: float) -> None:
        if self.on_gradient is not None:
            self.on_gradient(device)
        if REFERENCE_ONLY:
            self.optimizer.update_reference(
                device, lr=lr, grad_scale=grad_scale, chunk=DEVICE_CHUNK
            )
        else:
            self.optimizer.update_device(device, lr=lr, grad_scale=grad_scale, chunk=DEVICE_CHUNK)

    def _device_block(self, block: ParamBlock, staging: torch.Tensor) -> ParamBlock:
        """A ParamBlock over `staging`'s views, master and states copied in from the host."""
        parts = self.formats.staging_parts(block.numel)
        views = carve(staging, parts)
        shadow = views.pop() if self.formats.shadow else None
        names = [n for n in _host_tensors(block) if n != "shadow"]
        fields: dict[str, Any] = {}
        for name, view in zip(names, views, strict=True):
            host = getattr(block, name)
            assert host.dtype == view.dtype and host.numel() == view.numel(), (block.name, name)
            fields[name] = view.copy_(host.reshape(-1), non_blocking=True)
        held = self._held[block.name]
        return dataclasses.replace(
            block,
            **fields,
            shadow=shadow,
            grad=held[0],
            grad_unit=held[1] if len(held) > 1 else None,
            grad_pool=None,
        )

    def wait(self, block: ParamBlock) -> float:
        """Block the host until `block`'s device update is done and its master, states and
        weights are back on the host (sync point); seconds waited."""
        waited = self.worker.wait(block)
        back = self._back.pop(block.name, None)
        if back is not None:
            t0 = time.perf_counter()
            back.synchronize()  # sync point (host): the block's copies back are done
            waited += time.perf_counter() - t0
            self._spans.append((*self._began.pop(block.name), back))
        return waited

    def collect_seconds(self) -> float:
        """The share's seconds since the last call, over the updates waited for since: on
        CUDA the GPU's span of each block's copies in, AdamW and copies back (CUDA events;
        blocks overlapping on the two streams counted once), on the CPU the worker's time.
        No sync point: the waited blocks' events are complete."""
        busy, self.worker.busy_s = self.worker.busy_s, 0.0
        if not self.transfers.is_cuda:
            return busy
        spans, self._spans = sorted(self._spans, key=lambda s: s[0]), []
        if not spans:
            return 0.0
        first = spans[0][1]  # the up stream runs in issue order: the earliest start
        return covered([(first.elapsed_time(a), first.elapsed_time(b)) for _, a, b in spans]) / 1e3

    def wait_all(self) -> float:
        return sum(self.wait(b) for b in self.blocks)

    def close(self) -> None:
        self.wait_all()
        self.worker.close()


def covered(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of `intervals` ((start, end) pairs, any order)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _pin(block: ParamBlock) -> int:
    """Page-lock what the share copies of `block`: the large tensors where they lie
    (`pin_in_place`), the small ones (int8/int4 scales) moved into pinned memory of their own.
    A copy from pageable memory would wait for the stream's earlier work, so the worker could
    not queue the next block's copies behind this one's. Returns the bytes left pageable: large
    tensors not page-aligned or refused by cudaHostRegister (moving them would take their size
    again in host RAM)."""
    pageable = 0
    for name, tensor in _host_tensors(block).items():
        nbytes = tensor.numel() * tensor.element_size()
        if pin_in_place(tensor):
            continue
        if pinnable(nbytes):
            pageable += nbytes
        else:
            setattr(block, name, torch.empty_like(tensor, pin_memory=True).copy_(tensor))
    return pageable


def _host_tensors(block: ParamBlock) -> dict[str, torch.Tensor]:
    """What the update rewrites on the host: master, states (and scales), the bf16 shadow."""
    out = {"master": block.master, **block.state_tensors()}
    if block.shadow is not None:
        out["shadow"] = block.shadow
    return out
