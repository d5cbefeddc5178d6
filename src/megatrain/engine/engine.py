"""The streaming engine: one optimizer step over several micro-batches, layer-major.

It runs an `EnginePlan` (engine/plan.py), allocates every persistent device buffer from its
`DeviceLayout` (engine/layout.py) and issues loads and layer visits in the order of its
`StepSchedule` (engine/schedule.py), the lists the planner's timing model replays. Its parts
are mixins, one role each: forward.py, loss.py and backward.py, the step's passes; buffers.py,
the head's and embedding's device buffers and the list of every persistent one.

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
   The GPU update share (engine/gpu_share.py, `gpu_update_blocks`: the streamed blocks the host
   worker would reach last, the head and the last layers) keeps its gradients on the device
   too; a second worker thread copies each one's master and states in, updates it there and
   copies it back, beside the host worker; the next forward waits for it as for a host update.

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

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatrain.batch import Batch
from megatrain.engine.backward import BackwardPass
from megatrain.engine.boundaries import Boundaries
from megatrain.engine.buffers import DeviceBuffers
from megatrain.engine.collectives import Collectives
from megatrain.engine.forward import ForwardPass
from megatrain.engine.gpu_share import BlockFormats, GpuShare, share_of
from megatrain.engine.head import TokenObjective
from megatrain.engine.layout import (
    ACCUMULATORS,
    SHARE_GRADS,
    SHARE_STAGING,
    SLOTS,
    STAGING,
    BlockSizes,
    DeviceLayout,
)
from megatrain.engine.loss import LossPass
from megatrain.engine.microbatch import Embedder
from megatrain.engine.plan import EnginePlan
from megatrain.engine.rng import uses_randomness
from megatrain.engine.schedule import StepSchedule
from megatrain.engine.slots import LayerSlots, device_copy, move_body_buffers
from megatrain.engine.tier import GpuTier
from megatrain.engine.tiling import tile_per_token, tileable, untiled_layers
from megatrain.engine.timeline import ComputeTimer, Timeline
from megatrain.engine.transfers import DONE, Event, Transfers
from megatrain.engine.updates import UpdateWorker
from megatrain.engine.vision import VisionModules
from megatrain.model.capture import LayerCallCapture
from megatrain.model.router import RouterAux, RouterTap
from megatrain.model.structure import ModelStructure
from megatrain.optim.adamw import CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.reference import ReferenceWeights


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


class StreamingEngine(DeviceBuffers, ForwardPass, BackwardPass, LossPass):
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
    # called once the step's gradient norm is on the host, before its first update; raises to
    # stop the step (several ranks: another rank's out-of-memory step, recipes/oom.py; on CUDA
    # an aborted collective ends without an error, so the norm alone does not tell)
    before_updates: Callable[[], None] | None = None

    def __init__(
        self,
        structure: ModelStructure,
        store: HostStore,
        optimizer: CpuAdamW,
        plan: EnginePlan,
        *,
        device: str | torch.device = "cpu",
        threaded_optimizer: bool = True,
    ) -> None:
        """Runs `plan` (engine/plan.py); with `plan.world_size` > 1 `store` holds this rank's
        shards (store/shard.py). Every persistent device buffer comes from `self.layout`."""
        self.structure = structure
        self.store = store
        self.plan = plan
        self.device = torch.device(device)
        self.dtype = store.compute_dtype
        self.max_grad_norm = plan.clip_norm
        formats = BlockFormats(store.master_dtype, store.state_dtype, store.grad_hold)
        sizes = BlockSizes.of_store(store, structure.tied)
        self.layout = DeviceLayout.of(plan, sizes, self.dtype, formats)
        self.transfers = Transfers(self.device)
        self.comm = Collectives(self.transfers, world_size=plan.world_size, rank=plan.rank)
        move_body_buffers(structure, self.device)
        self.vision = VisionModules(structure, store.vision, self.layout, self.device, self.dtype)
        self.capture = LayerCallCapture(structure, self.vision.modules)
        self.tier = GpuTier.first_blocks(store, plan.gpu_state_blocks, optimizer, self.comm)
        self.slots = LayerSlots(
            structure.layers,
            store.layers,
            buffers=self.layout.empty(SLOTS, self.device),
            transfers=self.transfers,
            compile_layers=plan.compile_layers,
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
        self._build_head(plan.loss_chunk_tokens)
        # layers whose gradient accumulates in the shared accumulators (a sharded tier's too)
        self._acc = self.layout.empty(ACCUMULATORS, self.device)
        self._stage = self.layout.empty(STAGING, self.device) or None
        self._acc_busy: list[Event] = [DONE, DONE]
        self.aux = RouterAux.for_model(structure)
        self.taps = (
            [RouterTap(m, self.aux) for m in self.slots.modules] if self.aux is not None else []
        )
        self.worker = UpdateWorker(optimizer, threaded=threaded_optimizer)
        self.share = GpuShare(
            share_of(
                store.layers, store.head, lambda b: b not in self.tier, plan.gpu_update_blocks
            ),
            formats,
            optimizer,
            self.transfers,
            grads=self.layout.zeros(SHARE_GRADS, self.device),
            staging=self.layout.empty(SHARE_STAGING, self.device),
            threaded=threaded_optimizer,
        )
        boundaries = plan.boundary_plan(len(store.layers))
        self.boundaries = Boundaries(boundaries, self.device)
        self.schedule = StepSchedule.of(
            len(store.layers), self.tier.num_layers, self.slots.num_slots, boundaries
        )
        self._preserve_rng = uses_randomness(structure)
        if plan.tiles is not None:
            assert tileable(structure), "the plan tiles layers that draw random numbers"
            assert plan.untiled == untiled_layers(structure), plan.untiled
            tile_per_token(self.slots.modules, plan.tiles, set(plan.untiled))
        self._landed: dict[str, Event] = {}  # block name -> its gradient's device-to-host copy
        self._sumsq: list[torch.Tensor] = []  # squared gradient norm of each shipped block
        self._order = {b.name: i for i, b in enumerate(store.blocks)}  # forward position

    # ---------------------------------------------------------------- public API

    def train_step(
        self, batches: list[Batch], *, lr: float, objective: TokenObjective | None = None
    ) -> StepResult:
        """One optimizer step over `batches`: mean cross-entropy, or `objective`'s loss."""
        assert objective is None or len(objective.inputs) == len(batches)
        timeline, timer = Timeline(), ComputeTimer(self.transfers.is_cuda)
        self.step_timer = timer
        self.updates_begun = False
        self.share.on_gradient = self.worker.on_landed
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
            if self.before_updates is not None:
                self.before_updates()
            self.updates_begun = True
            for block in self.tier.blocks:  # before the next forward uses them (same stream)
                self._update_tier(block, lr, coef)
            for order, block in enumerate(self.store.blocks):  # forward order
                if block in self.tier:
                    continue
                updates = self.share if block in self.share else self.worker
                landed = self._landed[block.name]
                updates.submit(block, landed, order=order, lr=lr, grad_scale=coef)
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
        timeline.gpu_update_s = self.share.collect_seconds()
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
        out = self._label_logprobs(mbs, temperature)
        for mb in mbs:
            mb.hidden = None  # type: ignore[assignment]
        timer.stop()
        self._head_free = self.transfers.compute_event()
        return out

    def weights_loaded(self) -> None:
        """The store's weights were replaced (a checkpoint loaded): what the device keeps of
        them is stale; a sharded GPU tier gathers the loaded shards again."""
        self.slots.invalidate()
        self.tier.refresh()

    @contextlib.contextmanager
    def serving(self, reference: ReferenceWeights) -> Iterator[None]:
        """The passes inside (`logprobs`) run on `reference`'s weights: its copies are swapped
        into the store, and a GPU tier's device weights (never streamed from the store) are
        overwritten with them and rebuilt after. GRPO's KL reference, DPO's `dpo.reference:
        weights`. The caller waits for the updates first. A tier block's bf16 weights are
        rebuilt from its fp32 master on the device (a cast, rounded to nearest even as its
        update writes them: the same bits); fp32 compute (the weights are the master) keeps
        a host copy meanwhile (planned: planning/timing.py `reference_swap_s`). Under ranks a
        tier block's reference copy is this rank's shard: it goes into the rank's part of the
        whole device weights, and an all-gather completes them (engine/tier.py `rewrite`), on
        the way in and back."""
        kept = [
            None if self._rebuilt_from_master(b) else self.tier.own_weights(b).to("cpu", copy=True)
            for b in self.tier.blocks
        ]
        for block in self.tier.blocks:  # the copies never change: queued, not waited for
            self.tier.rewrite(block, reference.copy_of(block))
        self.slots.invalidate()  # the layers the device slots hold are the policy's
        try:
            with reference.swapped_in():
                yield
        finally:
            self.slots.invalidate()
            for block, own in zip(self.tier.blocks, kept, strict=True):
                self.tier.rewrite(block, block.master if own is None else own)

    def _rebuilt_from_master(self, block: ParamBlock) -> bool:
        """Whether a tier block's device weights (its own part) are the bf16 shadow of its
        fp32 master."""
        own = self.tier.own_weights(block)
        return own is block.shadow and block.master.dtype == torch.float32

    def tier_weights(self, block: ParamBlock) -> torch.Tensor | None:
        """The block's whole compute-dtype weights on the device if it is in the GPU tier
        (under ranks every rank's part, all-gathered), else None (it streams from the store)."""
        return self.tier.weights(block) if block in self.tier else None

    def wait_updates(self) -> None:
        """Block until every submitted optimizer update is applied (before save or export)."""
        self.worker.wait_all(self.store.blocks)
        self.share.wait_all()

    def wait_update(self, block: ParamBlock) -> float:
        """Block the host until `block`'s pending update (host or GPU share) is applied; the
        seconds waited. Sync point (host)."""
        return self.worker.wait(block) + self.share.wait(block)

    def abandon_step(self) -> None:
        """Undo a step that failed before any of its updates began (out of GPU memory): wait
        for what it queued, and give every block whose shadow received a gradient (a host
        block's, or a GPU-tier block's on the device) its weights back (from the untouched
        master). Then the engine is closed: the store is as it was before the step, ready for
        another engine (a sharded tier block's whole weights are gathered again by the next)."""
        assert not self.updates_begun, "the step's updates have begun: it cannot be undone"
        if self.transfers.is_cuda:  # sync point: every stream's work of the step is done
            torch.cuda.synchronize(self.device)
        self.close()  # the previous step's updates, queued with clipping, are applied
        for block in self.store.blocks:
            block.refresh_shadow()

    def close(self) -> None:
        self.wait_updates()
        self.worker.close()
        self.share.close()
