"""The streaming engine: one optimizer step over several micro-batches, layer-major.

Step schedule (docs/architecture.md, "One optimizer step"):
1. Forward without autograd. Embedding rows gathered per micro-batch; then for each layer i:
   wait for its weights, run it over every micro-batch, keep its input (boundary activation).
   Layers stream into `num_slots` device slots, the next ones copied while this one computes.
2. Loss: final norm + lm_head + cross-entropy per token chunk, forward and backward fused
   (engine/head.py). The loss is the sum over supervised tokens of the whole step divided by
   their count (not a mean of per-micro-batch means), plus the MoE router aux loss when the HF
   model would add it (mean over micro-batches of HF's per-forward value).
3. Backward, last layer first: each layer re-runs forward with autograd from its saved input;
   `torch.autograd.grad` gives the input gradient and parameter gradients, accumulated in fp32
   over micro-batches, then copied to the host (bf16 in bf16 compute) on a second stream.
4. AdamW per block on the host worker. Without clipping, each block's update starts as soon as
   its gradient lands (overlapping the rest of the backward). With clipping the global norm is
   known only after the whole backward; updates then run in forward order, overlapping the next
   step's forward, which waits for block i's update only before copying block i.

Shapes: B = rows, S = sequence, D = hidden size.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from megatrain.batch import Batch
from megatrain.engine.collectives import Collectives
from megatrain.engine.head import ChunkedLoss
from megatrain.engine.microbatch import Embedder, MicroBatch
from megatrain.engine.rng import restored_rng, rng_state, uses_randomness
from megatrain.engine.slots import LayerSlots, bind_module, device_copy
from megatrain.engine.timeline import ComputeTimer, Timeline
from megatrain.engine.transfers import DONE, Event, Transfers
from megatrain.engine.updates import UpdateWorker
from megatrain.model.capture import LayerCallCapture
from megatrain.model.router import RouterAux, RouterStats, RouterTap
from megatrain.model.structure import ModelStructure
from megatrain.optim.adamw import CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.shard import layout_numel


@dataclass
class StepResult:
    loss: float  # what the step minimised: ce_loss (+ router aux term)
    ce_loss: float  # mean cross-entropy over the step's supervised tokens
    aux_loss: float | None  # router_aux_loss_coef * mean aux loss, when HF would add it
    grad_norm: float  # global L2 norm of the gradient, before clipping
    clip_coef: float  # factor applied to the gradient (1.0 when not clipped)
    tokens: int
    target_tokens: int
    timeline: Timeline


class StreamingEngine:
    """Runs optimizer steps of a model whose weights live in a HostStore, streaming layers.

    Owns the device side: the weight slots, the head and embedding on the device, gradient
    accumulators, the copy streams, and the host worker that applies AdamW updates.
    Invariants: between steps the store's master weights, states and shadow are consistent
    once `wait_updates()` returns; a block is never copied to the device before its pending
    update is applied; the step's loss is the mean over all its supervised tokens; with
    clipping, updates use the exact global norm of the whole step's gradient.
    """

    def __init__(
        self,
        structure: ModelStructure,
        store: HostStore,
        optimizer: CpuAdamW,
        *,
        device: str | torch.device = "cpu",
        num_slots: int,
        max_grad_norm: float | None,
        loss_chunk_tokens: int | None = None,
        threaded_optimizer: bool = True,
        compile_layers: bool = False,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self.structure = structure
        self.store = store
        self.device = torch.device(device)
        self.dtype = store.compute_dtype
        assert max_grad_norm is None or max_grad_norm > 0, "clipping off is None, not 0"
        self.max_grad_norm = max_grad_norm
        self.transfers = Transfers(self.device)
        self.comm = Collectives(self.transfers, world_size=world_size, rank=rank)
        _move_body_buffers(structure, self.device)
        self.capture = LayerCallCapture(structure)
        self.slots = LayerSlots(
            structure.layers,
            store.layers,
            device=self.device,
            dtype=self.dtype,
            num_slots=num_slots,
            transfers=self.transfers,
            compile_layers=compile_layers,
            load=self.comm.load,
        )
        self.embedder = Embedder(
            device_copy(structure.embed, self.device), store.embed, self.transfers, self.dtype
        )
        self._build_head(loss_chunk_tokens)
        numel = max(layout_numel(b) for b in store.layers)
        self._acc = [torch.empty(numel, dtype=torch.float32, device=self.device) for _ in range(2)]
        self._stage = (
            [torch.empty(numel, dtype=torch.bfloat16, device=self.device) for _ in range(2)]
            if self.dtype == torch.bfloat16
            else None
        )
        self._acc_busy: list[Event] = [DONE, DONE]
        self.aux = RouterAux.for_model(structure)
        self.taps = (
            [RouterTap(m, self.aux) for m in self.slots.modules] if self.aux is not None else []
        )
        self.worker = UpdateWorker(optimizer, threaded=threaded_optimizer)
        self._preserve_rng = uses_randomness(structure)
        self._landed: dict[str, Event] = {}  # block name -> its gradient's device-to-host copy
        self._sumsq: list[torch.Tensor] = []  # squared gradient norm of each shipped block
        self._order = {b.name: i for i, b in enumerate(store.blocks)}  # forward position

    def _build_head(self, loss_chunk_tokens: int | None) -> None:
        st, store = self.structure, self.store
        self.norm = device_copy(st.final_norm, self.device)
        self.lm_head = device_copy(st.lm_head, self.device)
        head_numel, embed_numel = layout_numel(store.head), layout_numel(store.embed)
        self.head_buf = torch.empty(head_numel, dtype=self.dtype, device=self.device)
        self.head_params = bind_module(
            {"norm": self.norm, "lm_head": self.lm_head}, store.head, self.head_buf
        )
        self.head_acc = torch.zeros(head_numel, dtype=torch.float32, device=self.device)
        self.embed_acc = torch.zeros(embed_numel, dtype=torch.float32, device=self.device)
        self.embed_grad_VD = store.embed.view(self.embed_acc, store.embed.entries[0])
        self.head_grad_views = [store.head.view(self.head_acc, e) for e in store.head.entries]
        if st.tied:  # the lm_head is the embedding table: it goes to the GPU whole for the loss
            self.table_buf = torch.empty(embed_numel, dtype=self.dtype, device=self.device)
            self.head_params += bind_module({"embed": self.lm_head}, store.embed, self.table_buf)
            self.head_grad_views.append(self.embed_grad_VD)
        # Sharded: no host holds the whole embedding table; it is gathered on the device.
        self.embed_buf = (
            torch.empty(embed_numel, dtype=self.dtype, device=self.device)
            if self.comm.sharded
            else None
        )
        self._embed_free: Event = DONE
        self.loss_fn = ChunkedLoss(st, self.norm, self.lm_head, loss_chunk_tokens)
        self._head_ready: Event = DONE
        self._head_free: Event = DONE
        self._head_busy: list[Event] = []

    # ---------------------------------------------------------------- public API

    def train_step(self, batches: list[Batch], *, lr: float) -> StepResult:
        t0 = time.perf_counter()
        timeline, timer = Timeline(), ComputeTimer(self.transfers.is_cuda)
        # The loss divides by the supervised tokens of the whole step, on every rank.
        target_tokens = self.comm.sum_int(sum(b.num_target_tokens for b in batches))
        if target_tokens == 0:
            raise ValueError("this step has no supervised tokens (all labels are -100)")
        mbs = self._forward(batches, True, timeline, timer)
        t1 = time.perf_counter()
        ce, aux = self._loss(mbs, float(target_tokens), True, timer, lr)
        t2 = time.perf_counter()
        sumsq = self._backward(mbs, timer, lr)
        t3 = time.perf_counter()
        # sync point: end of backward; the sum over shards is the whole gradient's
        grad_norm = float(self.comm.sum(torch.stack(sumsq).sum()).sqrt())
        coef = 1.0
        if self.max_grad_norm is not None:
            coef = min(1.0, self.max_grad_norm / (grad_norm + 1e-6))
            for order, block in enumerate(self.store.blocks):  # forward order
                self.worker.submit(
                    block, self._landed[block.name], order=order, lr=lr, grad_scale=coef
                )
        self.slots.invalidate()
        loss_ce = float(self.comm.sum(ce))  # sync point (already synced above)
        aux_loss = None if aux is None else float(aux)
        timeline.forward_s, timeline.loss_s, timeline.backward_s = t1 - t0, t2 - t1, t3 - t2
        timeline.step_s = time.perf_counter() - t0
        timer.read(timeline)
        timeline.optimizer_s, self.worker.busy_s = self.worker.busy_s, 0.0
        return StepResult(
            loss=loss_ce + (aux_loss or 0.0),
            ce_loss=loss_ce,
            aux_loss=aux_loss,
            grad_norm=grad_norm,
            clip_coef=coef,
            tokens=self.comm.sum_int(sum(b.num_tokens for b in batches)),
            target_tokens=target_tokens,
            timeline=timeline,
        )

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch], *, counted: bool = True) -> tuple[float, int]:
        """(sum of cross-entropy over supervised tokens, their count) over all ranks; weights
        unchanged. `counted` False: a rank with no batch left runs one for the collectives'
        sake, and adds nothing."""
        timeline, timer = Timeline(), ComputeTimer(self.transfers.is_cuda)
        mbs = self._forward(batches, False, timeline, timer)
        ce, _ = self._loss(mbs, 1.0, False, timer, lr=0.0)
        tokens = sum(b.num_target_tokens for b in batches)
        if not counted:
            ce, tokens = torch.zeros_like(ce), 0
        return float(self.comm.sum(ce)), self.comm.sum_int(tokens)

    def wait_updates(self) -> None:
        """Block until every submitted optimizer update is applied (before save or export)."""
        self.worker.wait_all(self.store.blocks)

    def close(self) -> None:
        self.wait_updates()
        self.worker.close()

    # ---------------------------------------------------------------- forward

    def _forward(
        self, batches: list[Batch], training: bool, timeline: Timeline, timer: ComputeTimer
    ) -> list[MicroBatch]:
        timeline.wait_optimizer_s += self.worker.wait(self.store.embed)
        if self.embed_buf is not None:
            self.transfers.wait(self.comm.load(self.store.embed, self.embed_buf, self._embed_free))
            self.embedder.device_table = self.store.embed.view(
                self.embed_buf, self.store.embed.entries[0]
            )
        mbs = [
            self.embedder.start(b, self.capture, training, self.aux is not None) for b in batches
        ]
        self._embed_free = self.transfers.compute_event()
        layers = self.store.layers
        for j in range(min(self.slots.num_slots, len(layers))):
            self._load_layer(j, timeline)
        if self.slots.num_slots >= len(layers):
            self._load_head(timeline)
        for i in range(len(layers)):
            timer.start(functools.partial(self.slots.acquire, i))
            module = self.slots.modules[i]
            for mb in mbs:
                mb.saved.append(mb.hidden)
                if self._preserve_rng:
                    mb.rng.append(rng_state(self.device))
                with torch.no_grad():
                    mb.hidden = self._run_layer(i, module, mb, mb.hidden, record=True)
            timer.stop()
            self.slots.release(i)
            nxt = i + self.slots.num_slots
            if nxt < len(layers):
                self._load_layer(nxt, timeline)
                if nxt == len(layers) - 1:
                    self._load_head(timeline)
        return mbs

    def _load_layer(self, i: int, timeline: Timeline) -> None:
        timeline.wait_optimizer_s += self.worker.wait(self.store.layers[i])
        self.slots.load(i)

    def _load_head(self, timeline: Timeline) -> None:
        timeline.wait_optimizer_s += self.worker.wait(self.store.head)
        self._head_ready = self.comm.load(self.store.head, self.head_buf, after=self._head_free)
        if self.structure.tied:
            timeline.wait_optimizer_s += self.worker.wait(self.store.embed)
            self.transfers.wait(self._head_ready)
            self._head_ready = self.comm.load(
                self.store.embed, self.table_buf, after=self._head_free
            )

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

    # ---------------------------------------------------------------- loss

    def _loss(
        self, mbs: list[MicroBatch], denom: float, training: bool, timer: ComputeTimer, lr: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        for ev in self._head_busy:
            self.transfers.wait(ev)  # previous step's gradient copies out of the accumulators
        self._head_busy = []
        timer.start(lambda: self.transfers.wait(self._head_ready))
        if training:
            self.head_acc.zero_()
            self.embed_acc.zero_()
        ce = torch.zeros((), dtype=torch.float32, device=self.device)
        for mb in mbs:
            loss, mb.grad = self.loss_fn.run(
                mb.hidden,
                mb.targets_BS,
                denom,
                self.head_params if training else None,
                self.head_grad_views if training else None,
            )
            ce += loss
            mb.hidden = None  # type: ignore[assignment]
        timer.stop()
        self._head_free = self.transfers.compute_event()
        aux = self._aux_value(mbs)
        if training:
            self._sumsq = [self._ship(self.store.head, self.head_acc, lr)]
        return ce, aux

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

    # ---------------------------------------------------------------- backward

    def _backward(
        self, mbs: list[MicroBatch], timer: ComputeTimer, lr: float
    ) -> list[torch.Tensor]:
        layers, num_slots = self.store.layers, self.slots.num_slots
        for j in range(len(layers) - 1, max(-1, len(layers) - 1 - num_slots), -1):
            self.slots.load(j)  # no copy for layers still resident from the forward
        for i in range(len(layers) - 1, -1, -1):
            block = layers[i]
            k = i % 2
            self.transfers.wait(self._acc_busy[k])  # this accumulator's last copy-out is done
            acc = self._acc[k][: layout_numel(block)]
            timer.start(functools.partial(self.slots.acquire, i))
            acc.zero_()
            views = [block.view(acc, e) for e in block.entries]
            for mb in mbs:
                self._layer_backward(i, mb, views, len(mbs))
            timer.stop()
            self.slots.release(i)
            self._sumsq.append(self._ship(block, acc, lr, k))
            if i - num_slots >= 0:
                self.slots.load(i - num_slots)
        timer.start()
        for mb in mbs:
            self.embedder.backward(mb, self.embed_grad_VD)
        timer.stop()
        self._sumsq.append(self._ship(self.store.embed, self.embed_acc, lr))
        return self._sumsq

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

    def _ship(
        self, block: ParamBlock, acc: torch.Tensor, lr: float, k: int | None = None
    ) -> torch.Tensor:
        """Copy (this rank's shard of) a block's gradient to the host; returns its squared
        norm (on the device)."""
        acc = self.comm.reduce(block, acc)
        if self._stage is not None:  # bf16 compute: the gradient travels (and lands) as bf16
            src = (
                self._stage[k][: block.numel]
                if k is not None
                else torch.empty(block.numel, dtype=torch.bfloat16, device=self.device)
            )
            src.copy_(acc)
        else:
            src = acc
        sumsq = torch.linalg.vector_norm(src, dtype=torch.float32).square()
        landed = self.transfers.d2h(block.grad_landing, src, after=self.transfers.compute_event())
        if k is not None:
            self._acc_busy[k] = landed
        else:
            self._head_busy.append(landed)
        self._landed[block.name] = landed
        if self.max_grad_norm is None:
            self.worker.submit(block, landed, order=self._order[block.name], lr=lr, grad_scale=1.0)
        return sumsq


def _move_body_buffers(structure: ModelStructure, device: torch.device) -> None:
    """Body-level buffers (rotary inv_freq, ...) where the captured body runs; layers excluded."""
    in_layers = {id(m) for m in structure.layers.modules()}
    for module in structure.body.modules():
        if id(module) in in_layers:
            continue
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device and buf.device.type != "meta":
                module._buffers[name] = buf.to(device)
