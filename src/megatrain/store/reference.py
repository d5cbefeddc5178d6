"""Frozen reference weights: a host copy of every block's copy source, swapped in for a pass.

GRPO's KL term needs the log-probs of the initial model. Rather than a second model, the
reference keeps one copy of what the engine copies to the device for each block (the bf16
shadow: 2 bytes per parameter, or the fp32 master in fp32 compute: 4), and `swapped_in()` makes
the store's blocks serve those tensors for the duration of a forward pass through the same
engine. Under several ranks (store/shard.py) each rank keeps the copies of its own shards, and
the engine's all-gather assembles the reference as it does the weights; each rank saves its
part in its own file. Invariant: the copies never change after construction; the store's own
tensors are back in place when the context exits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.memory import host_zeros
from megatrain.store.shard import ShardedBlock, padded_numel


def copy_bytes(block_params: list[int], itemsize: int, world: int = 1) -> int:
    """Host bytes of a `ReferenceWeights` of blocks of `block_params` parameters at `itemsize`
    bytes each (the compute dtype), over every rank of `world` (each rank's padded shards,
    store/shard.py): also what its checkpoint files hold."""
    return sum(padded_numel(n, world) for n in block_params) * itemsize


class ReferenceWeights:
    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.copies: list[torch.Tensor] = []
        for block in store.blocks:
            src = block.source
            # page-locked where the store's copy source is, and for a GPU-tier block's (its
            # weights live on the device): `serving` copies it up every pass, at the link's
            # pinned rate, queued without waiting (never written again: no hazard)
            copy = host_zeros(src.numel(), src.dtype, pin=src.is_pinned() or src.is_cuda)
            copy.copy_(src)
            self.copies.append(copy)

    FILE = "reference.safetensors"

    @property
    def file_name(self) -> str:
        """Its file in a checkpoint: FILE, or under several ranks this rank's part of it
        (reference.rank<r>-of-<world>.safetensors: the copies of its shards)."""
        block = self.store.blocks[0]
        if not isinstance(block, ShardedBlock):
            return self.FILE
        return f"reference.rank{block.rank:03d}-of-{block.world_size:03d}.safetensors"

    def save(self, folder: Path) -> None:
        """Write the copies into a checkpoint folder (a resumed run keeps its reference)."""
        tensors = {b.name: c for b, c in zip(self.store.blocks, self.copies, strict=True)}
        save_file(tensors, str(folder / self.file_name))

    def load(self, folder: Path) -> None:
        """Read the copies back from checkpoint `folder`."""
        file = folder / self.file_name
        if not file.is_file():
            raise FileNotFoundError(
                f"checkpoint {folder} has no {self.file_name}: it was written without reference "
                "weights (grpo.beta 0, or another dpo.reference), or by another number of "
                "ranks; resume it as it was run, or start a new run"
            )
        with safe_open(str(file), framework="pt") as f:
            for block, copy in zip(self.store.blocks, self.copies, strict=True):
                copy.copy_(f.get_tensor(block.name))

    def copy_of(self, block: ParamBlock) -> torch.Tensor:
        """The reference copy of `block` (what the engine copies to the device for it)."""
        return self.copies[self.store.blocks.index(block)]

    def host_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The store's blocks serve the reference weights as their copy source.

        The caller makes sure no optimizer update is in flight and that nothing the device
        cached from the store's own weights is reused inside (or, afterwards, the reference's).
        """
        attr = "shadow" if self.store.blocks[0].shadow is not None else "master"
        own = [getattr(b, attr) for b in self.store.blocks]
        for block, copy in zip(self.store.blocks, self.copies, strict=True):
            setattr(block, attr, copy)
        try:
            yield
        finally:
            for block, mine in zip(self.store.blocks, own, strict=True):
                setattr(block, attr, mine)
