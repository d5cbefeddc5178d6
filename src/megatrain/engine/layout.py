"""Every persistent GPU buffer of the engine, and its bytes: one description, two users.

`DeviceLayout.of(plan, blocks, compute_dtype)` lists the buffers an engine running `plan` keeps
on its device for the whole run; the engine allocates them from it (`empty`, `zeros`), and the
planner's GPU figure (planning/estimate.py) sums the same list, built from the model's spec
instead of its store (`BlockSizes`). A CPU test compares the list with the tensors an engine
really holds (tests/engine/test_device_layout.py), so the two cannot drift apart.

Buffers (c = bytes of the compute dtype; "streamed" = layers outside the GPU tier):
- weight slots: min(num_slots, streamed) x the largest streamed layer, c each;
- gradient accumulators: 2 x the largest layer whose gradient is shared (streamed layers, and
  tier layers but where one owns its gradient: fp32 compute, one rank), fp32, one where no layer
  streams (a tier layer's gradient leaves its accumulator on the compute stream at once, a
  streamed one's by a copy the next layer's backward overlaps); and the streamed layers' bf16
  staging copies (bf16 compute only);
- head weights and the tied table (the lm_head is the table: it goes up whole), c, unless in
  the tier; head and embedding gradients, fp32, unless the tier block owns its gradient;
- the gathered embedding table (ranks, embedding not in the tier), c;
- a vision-language model's vision modules (tower, projector), resident: the frozen ones, c;
  the trained ones (model.freeze_vision / freeze_projector false), c, and their gradient, fp32;
- the GPU tier: per block its fp32 master (unless it is the weights), m and v as the store
  keeps them (fp32, bf16, or int8 codes with their scales) over the rank's shard, and its whole
  weights in the compute dtype (engine/tier.py); in fp32 compute also the shard's fp32
  gradient (bf16 compute lands it in the weights: engine/tier.py "Gradient");
- the GPU update share (engine/gpu_share.py, `gpu_update_blocks`: streamed blocks from the
  head back): each share block's held gradient in its landing format, and `share_sets` staging
  sets (one with a single share block) of the largest share block's master and states (+ bf16
  shadow), packed in uint8 buffers.

Invariant: under ranks a block's device layout is its padded length (store/shard.py
`padded_numel`), its tier states the shard's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatrain.engine.gpu_share import BlockFormats, packed_bytes, share_of
from megatrain.engine.plan import EnginePlan, tier_order
from megatrain.model.multimodal import vision_split
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.shard import padded_numel
from megatrain.store.states import state_nbytes

FP32 = torch.float32


@dataclass(frozen=True)
class BlockSizes:
    """What the layout needs of the model's blocks: parameters per block."""

    layers: tuple[int, ...]
    embed: int
    head: int
    tied: bool
    vision: int = 0  # a vision-language model's vision tower (on the device)
    projector: int = 0  # ... and its projector
    vision_unused: int = 0  # trained parts' parameters the features never reach: kept frozen

    @classmethod
    def of_store(cls, store: HostStore, tied: bool) -> BlockSizes:
        """The store's blocks (their full parameter counts, also when sharded)."""

        def full(b: ParamBlock) -> int:
            return int(getattr(b, "full_numel", 0) or b.numel)

        layers = tuple(full(b) for b in store.layers)
        tower, projector = vision_split(store.structure)
        return cls(
            layers, full(store.embed), full(store.head), tied, tower, projector, store.vision_unused
        )


@dataclass(frozen=True)
class Buffer:
    name: str
    count: int  # buffers of this shape (weight slots: one per slot)
    numel: int
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return self.count * self.numel * self.dtype.itemsize


# names, as the estimate reports them (planning/estimate.py)
SLOTS = "weight slots"
ACCUMULATORS = "gradient accumulators (fp32)"
STAGING = "gradient staging (bf16)"
HEAD = "head weights"
TABLE = "tied lm_head table"
HEAD_GRAD = "head gradient (fp32)"
EMBED_GRAD = "embedding gradient (fp32)"
GATHERED = "all-gathered embedding table (ranks)"
VISION = "vision modules (frozen)"
VISION_TRAIN = "vision weights (trained)"
VISION_GRAD = "vision gradient (fp32)"
TIER = "GPU tier (fp32 master, m, v as stored, weights holding the gradient)"
SHARE_GRADS = "GPU update share: held gradients"
SHARE_STAGING = "GPU update share: master and states staging"


@dataclass(frozen=True)
class DeviceLayout:
    buffers: tuple[Buffer, ...]

    @classmethod
    def of(
        cls,
        plan: EnginePlan,
        blocks: BlockSizes,
        compute_dtype: torch.dtype,
        formats: BlockFormats | None = None,
    ) -> DeviceLayout:
        """`formats`: how the store keeps its blocks (the GPU update share's buffers; None:
        fp32 master and states, the gradient held as the compute dtype's landing)."""
        world, c = plan.world_size, compute_dtype
        padded = [padded_numel(n, world) for n in _order(blocks)]
        *layers, embed, head = padded
        tier = min(plan.gpu_state_blocks, len(padded))
        in_tier = [i < tier for i in range(len(padded))]
        *layer_tier, embed_tier, head_tier = in_tier
        streamed = [n for n, t in zip(layers, layer_tier, strict=True) if not t]
        # a tier block owns an fp32 gradient in fp32 compute on one rank (engine/tier.py)
        owns = world == 1 and c != torch.bfloat16
        shared = streamed if owns else layers  # gradients through the accumulators
        acc = max(shared, default=0)
        slots = min(plan.num_slots, len(streamed))
        out = [
            Buffer(SLOTS, slots, max(streamed, default=0), c),
            Buffer(ACCUMULATORS, 2 if streamed else 1, acc, FP32),
            Buffer(STAGING, 2 if c == torch.bfloat16 and streamed else 0, acc, torch.bfloat16),
            Buffer(HEAD, 0 if head_tier else 1, head, c),
            Buffer(TABLE, 1 if blocks.tied and not embed_tier else 0, embed, c),
            Buffer(HEAD_GRAD, 0 if head_tier and owns else 1, head, FP32),
            Buffer(EMBED_GRAD, 0 if embed_tier and owns else 1, embed, FP32),
            Buffer(GATHERED, 1 if world > 1 and not embed_tier else 0, embed, c),
        ]
        trained = blocks.vision * plan.train_vision + blocks.projector * plan.train_projector
        trained -= blocks.vision_unused if trained else 0
        out += [
            Buffer(VISION, 1, blocks.vision + blocks.projector - trained, c),
            Buffer(VISION_TRAIN, 1, trained, c),
            Buffer(VISION_GRAD, 1, trained, FP32),
        ]
        tier_sizes = [n for n, t in zip(padded, in_tier, strict=True) if t]
        fmt = formats or BlockFormats(hold="shadow" if c == torch.bfloat16 else "fp32")
        tier_bytes = sum(_tier_block_bytes(n, n // world, c, fmt.state_dtype) for n in tier_sizes)
        out.append(Buffer(TIER, 1, tier_bytes, torch.uint8))
        pairs = share_of(
            list(zip(layers, layer_tier, strict=True)),
            (head, head_tier),
            lambda pair: not pair[1],
            plan.gpu_update_blocks,
        )
        share = [n for n, _ in pairs]
        grads = sum(packed_bytes(fmt.gradient_parts(n)) for n in share)
        staging = max((packed_bytes(fmt.staging_parts(n)) for n in share), default=0)
        out.append(Buffer(SHARE_GRADS, 1, grads, torch.uint8))
        out.append(Buffer(SHARE_STAGING, min(plan.share_sets, len(share)), staging, torch.uint8))
        return cls(tuple(b for b in out if b.count and b.numel))

    def __getitem__(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    def __contains__(self, name: str) -> bool:
        return any(b.name == name for b in self.buffers)

    def numel(self, name: str) -> int:
        """A buffer's length; 0 for one the plan does not need."""
        return self[name].numel if name in self else 0

    def empty(self, name: str, device: torch.device) -> list[torch.Tensor]:
        """The `count` buffers of `name` (none if the plan has none), uninitialised."""
        if name not in self:
            return []
        b = self[name]
        return [torch.empty(b.numel, dtype=b.dtype, device=device) for _ in range(b.count)]

    def zeros(self, name: str, device: torch.device) -> torch.Tensor | None:
        """The one buffer of `name`, zeroed; None if the plan has none."""
        if name not in self:
            return None
        b = self[name]
        assert b.count == 1, b
        return torch.zeros(b.numel, dtype=b.dtype, device=device)

    def bytes_by_name(self) -> dict[str, int]:
        return {b.name: b.bytes for b in self.buffers}

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)


def _tier_block_bytes(whole: int, own: int, c: torch.dtype, state_dtype: str) -> int:
    """Device bytes of a GPU-tier block of `whole` parameters, `own` of them this rank's: the
    whole weights in the compute dtype; of its own part the fp32 master and m and v as stored
    (store/states.py state_nbytes); in fp32 compute, where the master is the weights, the fp32
    gradient instead of the master (bf16 compute lands it in the weights)."""
    return whole * c.itemsize + 4 * own + state_nbytes(own, state_dtype)


def _order(blocks: BlockSizes) -> Sequence[int]:
    return tier_order(blocks.layers, blocks.embed, blocks.head)


def held_bytes(tensors: dict[str, Sequence[torch.Tensor]]) -> dict[str, int]:
    """Bytes of an engine's real buffers by layout name (what the layout test compares)."""
    return {
        name: sum(t.numel() * t.element_size() for t in ts)
        for name, ts in tensors.items()
        if sum(t.numel() for t in ts)
    }
