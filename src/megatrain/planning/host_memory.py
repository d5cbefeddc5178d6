"""Host RAM of a run: the store's pageable and pinned bytes, the process, offloaded layer
inputs, and the peak while the model loads (one process, or the ranks of one node)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatrain.engine.plan import TierSplit
from megatrain.planning.hardware import Hardware
from megatrain.planning.ranks import ONE_PROCESS, Ranks
from megatrain.planning.spec import ModelSpec
from megatrain.store.grads import pool_buffers
from megatrain.store.master import weight_buffers
from megatrain.store.memory import HUGE_PAGE_MIN_BYTES
from megatrain.store.states import state_nbytes


@dataclass(frozen=True)
class HostMemory:
    pageable_bytes: int
    pinned_bytes: int  # what the store asks for
    pinned_reserved_bytes: int  # what is page-locked: 2 MiB or power-of-two rounding
    baseline_bytes: int  # python + torch + CUDA context (+ NCCL under ranks)
    data_bytes: int
    total_bytes: int
    load_peak_bytes: int  # while the fp32 model moves into the store (ranks: one at a time)
    offload_bytes: int = 0  # layer inputs offloaded during the step (in total_bytes)
    load_extra_bytes: int = 0  # ranks: what each more rank loading at once adds to the peak
    load_moved_bytes: int = 0  # in load_peak_bytes: the fp32 copy of the block being moved

    @property
    def store_bytes(self) -> int:
        return self.pageable_bytes + self.pinned_bytes

    def load_peak_at_once(self, n: int) -> int:
        """The node's peak while `n` of its ranks load at once (load_peak_bytes: one)."""
        return self.load_peak_bytes + (max(n, 1) - 1) * self.load_extra_bytes

    def loading_at_once(self, room: float, local: int) -> int:
        """How many of the node's `local` ranks can load at once within `room` bytes: the
        most whose peak fits, at least 1 (one at a time; the fit check reports the rest)."""
        fits = [n for n in range(1, local + 1) if self.load_peak_at_once(n) <= room]
        return max(fits, default=1)


def host_memory(
    spec: ModelSpec,
    hw: Hardware,
    *,
    data_bytes: int = 0,
    pin_memory: bool = True,
    state_dtype: str = "fp32",
    master_dtype: str = "fp32",
    grad_hold: str | None = None,
    gpu_state_blocks: int = 0,
    offload_bytes: int = 0,
    ranks: Ranks = ONE_PROCESS,
    vision: tuple[int, int] = (0, 0),
) -> HostMemory:
    """Host bytes of one process, or with several ranks of one node (its ranks' shards).
    `vision`: a vision-language model's (frozen, trained) vision parameters: the frozen stay
    in the HF model in fp32, the trained are one more block of the store."""
    frozen, trained = vision
    layers = [la.params for la in spec.layers]
    first = [trained] if trained else []
    every = [*first, spec.embed_params, *layers, spec.head_params]
    order = [*layers, spec.embed_params, spec.head_params, *first]  # tier order (engine/tier.py)
    held = [ranks.shard(n) for n in order[gpu_state_blocks:]]
    local = ranks.nproc_per_node if ranks.world > 1 else 1

    def store(numels: list[int]) -> tuple[int, int, int]:
        """(pageable, pinned, pinned as reserved) bytes of these blocks on the host."""
        bf16 = spec.compute_dtype == torch.bfloat16
        pageable = sum(state_nbytes(n, state_dtype) for n in numels)
        pinned_per_block = []
        for n in numels:  # master, streamed copy, gradient landing (store/master.py)
            weights, pinned_buffers = weight_buffers(
                n, master_dtype, bf16_compute=bf16, grad_hold=grad_hold
            )
            pageable += weights
            pinned_per_block += pinned_buffers
        pinned_per_block += pool_buffers(numels, grad_hold or "")  # shared landings
        pinned = sum(pinned_per_block)
        reserved = sum(pinned_reserved(b) for b in pinned_per_block) if pin_memory else pinned
        return pageable, pinned, reserved

    own = store(held)  # one process's (under ranks: one rank's shards)
    kept = own[0] + own[2]  # what it keeps on the host: pageable + pinned as reserved
    pageable, pinned, reserved = (local * b for b in own)
    baseline = hw.process_baseline_bytes + ranks.host_extra_bytes + 4 * frozen
    process = local * (baseline + data_bytes)
    total = pageable + reserved + process + local * offload_bytes
    twice = 4 * max(every)  # the block being moved exists twice
    # The fp32 model at first, what the store keeps at the end: each block moves from one to
    # the other. A GPU-tier block is built whole on the host, then goes to the device before
    # the next is built (store/host.py): its whole store beside the rest of the model.
    model = 4 * sum(every)
    loading = max(kept, model) + twice
    if ranks.world == 1 and gpu_state_blocks:
        tier_peak = _tier_built(
            every, bool(first), gpu_state_blocks, lambda n: sum(store([n])[::2])
        )
        loading = max(loading, tier_peak)
    loading += process
    extra = 0
    if ranks.world > 1:
        # A loading rank holds its whole fp32 model at first and its shards outside the GPU
        # tier at the end. A rank that has loaded holds those; the others, nothing yet. With
        # ranks loading one at a time the node peaks in the last turn.
        loader = max(model, kept) + twice
        loading = (local - 1) * kept + loader + process
        extra = loader - kept
    return HostMemory(
        pageable_bytes=pageable,
        pinned_bytes=pinned,
        pinned_reserved_bytes=reserved,
        baseline_bytes=local * baseline,
        data_bytes=local * data_bytes,
        total_bytes=total,
        load_peak_bytes=loading,
        offload_bytes=local * offload_bytes,
        load_extra_bytes=extra,
        load_moved_bytes=twice,
    )


def _tier_built(
    every: list[int],
    vision: bool,
    count: int,
    kept_of: Callable[[int], int],
) -> int:
    """The host's most while a GPU-tier block is built whole on it (store/host.py), over the
    first `count` blocks of the tier: the rest of the fp32 model, the blocks kept on the host
    built before it, and its own store. `every`: the blocks' sizes in build order ((vision,)
    embedding, layers, head); `kept_of(n)`: the host bytes a block of n parameters keeps in
    the store (pageable and pinned as reserved)."""
    layers = len(every) - 2 - vision
    split = TierSplit.of(layers, count)
    in_tier = [False] * vision + [split.embed, *(i < split.layers for i in range(layers))]
    kept, most, later = 0, 0, 4 * sum(every)
    for tier, n in zip([*in_tier, split.head], every, strict=True):
        later -= 4 * n  # the fp32 blocks not built yet
        if tier:
            most = max(most, later + kept + kept_of(n))
        else:
            kept += kept_of(n)
    return most


def _pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def pinned_reserved(nbytes: int) -> int:
    """Host bytes a pinned block costs (megatrain.store.memory.host_zeros).

    Blocks of 32 MiB and more are huge-page mappings registered with cudaHostRegister: their
    size rounded up to 2 MiB. Smaller ones come from torch's caching host allocator, which
    rounds up to a power of two.
    """
    if nbytes >= HUGE_PAGE_MIN_BYTES:
        return -(-nbytes // (2 << 20)) * (2 << 20)
    return _pow2_ceil(nbytes)
