"""The streaming engine: one optimizer step over several micro-batches, layer-major.

Step schedule (docs/architecture.md, "One optimizer step"):
1. Forward without autograd. Embedding rows gathered per micro-batch; then for each layer i:
   wait for its weights, run it over every micro-batch, keep its input (boundary activation:
   on the device, offloaded to the host or dropped, engine/boundaries.py). Layers stream
   into `num_slots` device slots, the next ones copied while this one computes.
2. Loss: final norm + lm_head + cross-entropy per token chunk, forward and backward fused
   (engine/head.py). The loss is the sum over supervised tokens of the whole step divided by
   their count (not a mean of per-micro-batch means), plus the MoE router aux loss when the HF
   model would add it (mean over micro-batches of HF's per-forward value). With a
   `TokenObjective` (GRPO) the first term is instead the sum of its per-token function of the
   targets' log-probs; `logprobs()` gives those log-probs without a step.
3. Backward, last layer first (a dropped input is first recomputed from the kept one before
   it): each layer re-runs forward with autograd from its saved input;
   `torch.autograd.grad` gives the input gradient and parameter gradients, accumulated in fp32
   over micro-batches, then copied to the host (bf16 in bf16 compute) on a second stream.
4. AdamW per block on the host worker. Without clipping, each block's update starts as soon as
   its gradient lands (overlapping the rest of the backward). With clipping the global norm is
   known only after the whole backward; updates then run in forward order, overlapping the next
   step's forward, which waits for block i's update only before copying block i.
   Blocks of the GPU tier (engine/tier.py: the first layers, then the embedding and the head)
   stay on the device: never copied, their gradient kept there, their AdamW run there on the
   compute stream (right after their backward, or with clipping once the global norm is known).

Several ranks (engine/collectives.py, store/shard.py): every block's weights reach the device
as this rank's shard copied host-to-device and then all-gathered; its gradient leaves as a
reduce-scatter, so each rank's host AdamW updates its own shard. The step's supervised token
count, loss and squared gradient norm are summed over ranks, so the loss is the mean over
every supervised token of the global step and clipping uses the whole gradient's norm. A GPU
tier is sharded too (engine/tier.py): each rank keeps its shard's states on its GPU, every rank
the whole block's weights; the tier's gradient is reduce-scattered, its update all-gathered.

Shapes: B = rows, S = sequence, D = hidden size.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from megatrain.batch import Batch
from megatrain.engine.backward import BackwardPass
from megatrain.engine.boundaries import Boundaries, BoundaryPlan
from megatrain.engine.collectives import Collectives
from megatrain.engine.head import ChunkedLoss, TokenObjective
from megatrain.engine.loss import LossPass
from megatrain.engine.microbatch import Embedder, MicroBatch
from megatrain.engine.rng import rng_state, uses_randomness
from megatrain.engine.slots import LayerSlots, bind_module, device_copy, move_body_buffers
from megatrain.engine.tier import GpuTier
from megatrain.engine.tiling import TilePolicy, tile_per_token
from megatrain.engine.timeline import ComputeTimer, Timeline
from megatrain.engine.transfers import DONE, Event, Transfers
from megatrain.engine.updates import UpdateWorker
from megatrain.model.capture import LayerCallCapture
from megatrain.model.router import RouterAux, RouterTap
from megatrain.model.structure import ModelStructure
from megatrain.optim.adamw import CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.shard import layout_numel


@dataclass
class StepResult:
    loss: float  # what the step minimised: ce_loss or the objective (+ router aux term)
    ce_loss: float  # mean cross-entropy over the step's supervised tokens (at the temperature)
    aux_loss: float | None  # router_aux_loss_coef * mean aux loss, when HF would add it
    grad_norm: float  # global L2 norm of the gradient, before clipping
    clip_coef: float  # factor applied to the gradient (1.0 when not clipped)
    tokens: int
    target_tokens: int
    timeline: Timeline


class StreamingEngine(BackwardPass, LossPass):
    """Runs optimizer steps of a model whose weights live in a HostStore, streaming layers.

    Owns the device side: the weight slots, the head and embedding on the device, gradient
    accumulators, the copy streams, and the host worker that applies AdamW updates.
    Invariants: between steps the store's master weights, states and shadow are consistent
    once `wait_updates()` returns; a block is never copied to the device before its pending
    update is applied; the step's loss is the mean over all its supervised tokens; with
    clipping, updates use the exact global norm of the whole step's gradient.
    """

    # set once a step's first update is queued: from then on that step cannot be undone
    updates_begun = False

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
        gpu_state_blocks: int = 0,
        world_size: int = 1,
        rank: int = 0,
        boundary_plan: BoundaryPlan | None = None,
        mlp_tiles: TilePolicy | None = None,
    ) -> None:
        """`gpu_state_blocks`: blocks whose states live on the device (engine/tier.py);
        `world_size` > 1: `store` holds this rank's shards (store/shard.py), a tier's too;
        `boundary_plan`: where layer inputs wait for the backward (engine/boundaries.py; None:
        all on the device); `mlp_tiles`: sequence tiles of the MLPs (engine/tiling.py)."""
        self.structure = structure
        self.store = store
        self.device = torch.device(device)
        self.dtype = store.compute_dtype
        assert max_grad_norm is None or max_grad_norm > 0, "clipping off is None, not 0"
        self.max_grad_norm = max_grad_norm
        self.transfers = Transfers(self.device)
        self.comm = Collectives(self.transfers, world_size=world_size, rank=rank)
        move_body_buffers(structure, self.device)
        self.capture = LayerCallCapture(structure)
        self.tier = GpuTier.first_blocks(store, gpu_state_blocks, optimizer, self.comm)
        self.slots = LayerSlots(
            structure.layers,
            store.layers,
            device=self.device,
            dtype=self.dtype,
            num_slots=num_slots,
            transfers=self.transfers,
            compile_layers=compile_layers,
            resident=self.tier.num_layers,
            resident_weights=self.tier.weights,
            load=self.comm.load,
        )
        self.embedder = Embedder(
            device_copy(structure.embed, self.device),
            store.embed,
            self.transfers,
            self.dtype,
            table=self.tier.weights(store.embed) if store.embed in self.tier else None,
        )
        self._build_head(loss_chunk_tokens)
        # layers whose gradient accumulates in the shared accumulators (a sharded tier's too)
        shared = [b for b in store.layers if not self.tier.owns_gradient(b)]
        numel = max((layout_numel(b) for b in shared), default=0)
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
        plan = boundary_plan or BoundaryPlan.on_device(len(store.layers))
        assert plan.num_layers == len(store.layers), (plan.num_layers, len(store.layers))
        self.boundaries = Boundaries(plan, self.device)
        self._preserve_rng = uses_randomness(structure)
        # not where router logits are recorded, nor with dropout (a tile's re-run would draw
        # other masks): engine/tiling.py
        if mlp_tiles is not None and not self._preserve_rng:
            skip = {i for i, tap in enumerate(self.taps) if tap.has_router}
            tile_per_token(self.slots.modules, mlp_tiles, skip)
        self._landed: dict[str, Event] = {}  # block name -> its gradient's device-to-host copy
        self._sumsq: list[torch.Tensor] = []  # squared gradient norm of each shipped block
        self._order = {b.name: i for i, b in enumerate(store.blocks)}  # forward position

    def _build_head(self, loss_chunk_tokens: int | None) -> None:
        st, store = self.structure, self.store
        self.norm = device_copy(st.final_norm, self.device)
        self.lm_head = device_copy(st.lm_head, self.device)
        # GPU-tier blocks bring their own device weights and fp32 gradient
        self.head_buf, self.head_acc = self._device_buffers(store.head)
        self.head_params = bind_module(
            {"norm": self.norm, "lm_head": self.lm_head}, store.head, self.head_buf
        )
        self.table_buf, self.embed_acc = self._device_buffers(store.embed, st.tied)
        self.head_grad_views = [store.head.view(self.head_acc, e) for e in store.head.entries]
        if st.tied:  # the lm_head is the embedding table: it goes to the GPU whole for the loss
            self.head_params += bind_module({"embed": self.lm_head}, store.embed, self.table_buf)
            self.head_grad_views.append(store.embed.view(self.embed_acc, store.embed.entries[0]))
        # Sharded: no host holds the whole embedding table; it is gathered on the device
        # (unless it is resident: the GPU tier's).
        self.embed_buf = (
            torch.empty(layout_numel(store.embed), dtype=self.dtype, device=self.device)
            if self.comm.sharded and store.embed not in self.tier
            else None
        )
        self._embed_free: Event = DONE
        self.loss_fn = ChunkedLoss(st, self.norm, self.lm_head, loss_chunk_tokens)
        self._head_ready: Event = DONE
        self._head_free: Event = DONE
        self._head_busy: list[Event] = []

    def _device_buffers(
        self, block: ParamBlock, weights: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(compute-dtype weights, fp32 gradient) of a head or embedding block on the device:
        the GPU tier's (its gradient too unless sharded), else new buffers (weights empty if
        not `weights`)."""
        n = layout_numel(block)
        if self.tier.owns_gradient(block):
            assert block.grad is not None
            return self.tier.weights(block), block.grad
        return (
            self.tier.weights(block)
            if block in self.tier
            else torch.empty(n if weights else 0, dtype=self.dtype, device=self.device),
            torch.zeros(n, dtype=torch.float32, device=self.device),
        )

    # ---------------------------------------------------------------- public API

    def train_step(
        self, batches: list[Batch], *, lr: float, objective: TokenObjective | None = None
    ) -> StepResult:
        """One optimizer step over `batches`: mean cross-entropy, or `objective`'s loss."""
        assert objective is None or len(objective.inputs) == len(batches)
        timeline, timer = Timeline(), ComputeTimer(self.transfers.is_cuda)
        self.updates_begun = False
        t0 = timer.mark()
        # The loss divides by the supervised tokens of the whole step, on every rank.
        target_tokens = self.comm.sum_int(sum(b.num_target_tokens for b in batches))
        if target_tokens == 0:
            raise ValueError("this step has no supervised tokens (all labels are -100)")
        mbs = self._forward(batches, True, timeline, timer)
        t1 = timer.mark()
        value, nll, aux = self._loss(mbs, float(target_tokens), True, timer, lr, objective)
        t2 = timer.mark()
        sumsq = self._backward(mbs, timer, lr)
        t3 = timer.mark()
        # sync point: end of backward; the sum over shards is the whole gradient's
        grad_norm = float(self.comm.sum(torch.stack(sumsq).sum()).sqrt())
        coef = 1.0
        if self.max_grad_norm is not None:
            coef = min(1.0, self.max_grad_norm / (grad_norm + 1e-6))
            self.updates_begun = True
            for block in self.tier.blocks:  # before the next forward uses them (same stream)
                self._update_tier(block, lr, coef)
            for order, block in enumerate(self.store.blocks):  # forward order
                if block in self.tier:
                    continue
                self.worker.submit(
                    block, self._landed[block.name], order=order, lr=lr, grad_scale=coef
                )
        self.slots.invalidate()
        # sync points (already synced above); cross-entropy unchanged: sum of (chunk sum / count)
        value = self.comm.sum(value)  # each rank's part of the global mean
        loss_ce = float(value) if objective is None else float(self.comm.sum(nll)) / target_tokens
        main = loss_ce if objective is None else float(value)
        aux_loss = None if aux is None else float(aux)
        timeline.forward_s, timeline.loss_s, timeline.backward_s = t1 - t0, t2 - t1, t3 - t2
        timeline.step_s = time.perf_counter() - t0
        timer.read(timeline)
        timeline.optimizer_s, self.worker.busy_s = self.worker.busy_s, 0.0
        return StepResult(
            loss=main + (aux_loss or 0.0),
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
        ce, _, _ = self._loss(mbs, 1.0, False, timer, lr=0.0)
        tokens = sum(b.num_target_tokens for b in batches)
        if not counted:
            ce, tokens = torch.zeros_like(ce), 0
        return float(self.comm.sum(ce)), self.comm.sum_int(tokens)

    @torch.no_grad()
    def logprobs(self, batches: list[Batch], *, temperature: float = 1.0) -> list[torch.Tensor]:
        """Per micro-batch, host fp32 [B, S]: entry t is the log-prob of input_ids[t] (under
        logits / temperature) where labels[t] is supervised, else 0. Weights unchanged."""
        timeline, timer = Timeline(), ComputeTimer(self.transfers.is_cuda)
        mbs = self._forward(batches, False, timeline, timer)
        self._wait_head(timer)
        out = []
        for mb in mbs:
            shifted = self.loss_fn.logprobs(mb.hidden, mb.targets_BS, temperature)
            mb.hidden = None  # type: ignore[assignment]
            logp = torch.zeros_like(shifted)
            logp[:, 1:] = shifted[:, :-1]  # back to label alignment: position t+1 held by t
            out.append(logp)
        timer.stop()
        self._head_free = self.transfers.compute_event()
        return out

    def weights_loaded(self) -> None:
        """The store's weights were replaced (a checkpoint loaded): what the device keeps of
        them is stale; a sharded GPU tier gathers the loaded shards again."""
        self.slots.invalidate()
        self.tier.refresh()

    def weights_swapped(self) -> None:
        """The store's blocks serve other weights for the next passes, or their own again
        (GRPO's KL reference swapped in or out): the layers the device slots hold are stale."""
        self.slots.invalidate()

    def wait_updates(self) -> None:
        """Block until every submitted optimizer update is applied (before save or export)."""
        self.worker.wait_all(self.store.blocks)

    def abandon_step(self) -> None:
        """Undo a step that failed before any of its updates began (out of GPU memory): wait
        for what it queued, and give every host block whose shadow received a gradient its
        weights back (from the untouched master). Then the engine is closed: the store is as
        it was before the step, ready for another engine."""
        assert not self.updates_begun, "the step's updates have begun: it cannot be undone"
        if self.transfers.is_cuda:  # sync point: every stream's work of the step is done
            torch.cuda.synchronize(self.device)
        self.close()  # the previous step's updates, queued with clipping, are applied
        for block in self.store.blocks:
            if block not in self.tier:
                block.refresh_shadow()

    def close(self) -> None:
        self.wait_updates()
        self.worker.close()

    # ---------------------------------------------------------------- forward

    def _forward(
        self, batches: list[Batch], training: bool, timeline: Timeline, timer: ComputeTimer
    ) -> list[MicroBatch]:
        timeline.wait_optimizer_s += self.worker.wait(self.store.embed)
        if self.embed_buf is not None:  # sharded: gather the table (sync point: compute waits)
            self.transfers.wait(self.comm.load(self.store.embed, self.embed_buf, self._embed_free))
            self.embedder.device_table = self.store.embed.view(
                self.embed_buf, self.store.embed.entries[0]
            )
        mbs = [
            self.embedder.start(b, self.capture, training, self.aux is not None) for b in batches
        ]
        self._embed_free = self.transfers.compute_event()
        layers, first = self.store.layers, self.slots.resident  # first streamed layer
        for j in range(first, first + self.slots.num_slots):
            self._load_layer(j, timeline)
        if first + self.slots.num_slots >= len(layers):
            self._load_head(timeline)
        for i in range(len(layers)):
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
            nxt = i + self.slots.num_slots
            if i >= first and nxt < len(layers):
                self._load_layer(nxt, timeline)
                if nxt == len(layers) - 1:
                    self._load_head(timeline)
        return mbs

    def _load_layer(self, i: int, timeline: Timeline) -> None:
        timeline.wait_optimizer_s += self.worker.wait(self.store.layers[i])
        self.slots.load(i)

    def _load_head(self, timeline: Timeline) -> None:
        if self.store.head not in self.tier:
            timeline.wait_optimizer_s += self.worker.wait(self.store.head)
            self._head_ready = self.comm.load(self.store.head, self.head_buf, self._head_free)
        if self.structure.tied and self.store.embed not in self.tier:
            timeline.wait_optimizer_s += self.worker.wait(self.store.embed)
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
