"""Build the host parameter store from a loaded Hugging Face model, block by block.

Each block's parameters are copied into its flat fp32 master and replaced in the HF model by
meta tensors at once, so host memory never holds the model twice: the HF module tree stays
behind as a weightless skeleton, used for structure, for capture, and to export (views of the
master are bound into it for `save_pretrained`, then unbound).

Tied weights (lm_head = embedding) are stored once, in the embedding block.

A GPU-tier block (`device_blocks`) moves to the device as soon as it is built
(`ParamBlock.to_device`, what engine/tier.py would do once the store is complete), so its host
copies are freed before the next block is built: the host holds one tier block at a time, and
the load's host peak is what the store keeps, or the fp32 model itself beside the tier block
being built (planning/host_memory.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel

from megatrain.model.multimodal import unused_vision_params
from megatrain.model.structure import ModelStructure
from megatrain.store.blocks import ParamBlock, ParamEntry
from megatrain.store.grads import LandingPool, allocate_hold, gradient_hold, pool_buffers
from megatrain.store.master import bf16_master_of, check_master_dtype
from megatrain.store.memory import host_zeros
from megatrain.store.states import check_state_dtype

DEFAULT_NO_DECAY = ("bias", "norm")


class HostStore:
    """Every trainable parameter and optimizer state of the model, in host memory.

    Owns one ParamBlock per embedding, decoder layer and head (forward order): fp32 master,
    AdamW m and v, and the bf16 shadow the device copies from (which also receives the layer's
    gradient between its backward and its update). Invariants: each parameter lives in exactly
    one block (a tied lm_head in the embedding's); within a block the decayed parameters come
    first; the HF model's parameters are replaced by meta tensors, so weights exist once.

    `state_dtype` (choices.py STATE_DTYPES; store/states.py) is the layout of every block's
    AdamW m and v; `master_dtype` ("fp32", "bf16"; store/master.py) that of its master: a bf16
    master is pinned and is itself the copy the device streams (no shadow), and the gradient
    lands in a buffer of its own (`ParamBlock.grad`): bf16 or int8 per `grad_dtype` with
    `clipping`, one of a few shared landings without (store/grads.py `gradient_hold`).
    """

    def __init__(
        self,
        structure: ModelStructure,
        *,
        compute_dtype: torch.dtype = torch.bfloat16,
        pin_memory: bool = False,
        no_decay: Sequence[str] = DEFAULT_NO_DECAY,
        decay_1d: bool = False,
        state_dtype: str = "fp32",
        master_dtype: str = "fp32",
        grad_dtype: str = "bf16",
        clipping: bool = True,
        shard: Callable[..., ParamBlock] | None = None,
        vision: dict[str, nn.Module] | None = None,
        device_blocks: Collection[str] = (),
        device: torch.device | None = None,
    ) -> None:
        """`shard`: under ranks, what each block becomes once its whole fp32 master is built
        (this rank's part, store/shard.py shard_master, called with the master and the block's
        name, entries, decay_numel, state_dtype, master_dtype and whether compute is bf16): a
        rank never holds more than one whole master of its own, and never whole states or
        shadows.
        `vision`: a vision-language model's vision parts that train (by dotted name under its
        multimodal body; model/multimodal.py trained_vision), one block "vision", first in
        forward order; the frozen ones stay in the HF model as loaded. `device_blocks`: the
        GPU tier's blocks (engine/plan.py `tier_names`), moved to `device` as each is built."""
        check_state_dtype(state_dtype)
        check_master_dtype(master_dtype)
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute dtype must be bfloat16 or float32, got {compute_dtype}")
        if master_dtype == "bf16" and compute_dtype != torch.bfloat16:
            raise ValueError(
                "optimizer.master_dtype: bf16 needs model.compute_dtype: bf16 (the bf16 master "
                "is the copy the device computes with); set one of them to the other's value"
            )
        self.structure = structure
        self.compute_dtype = compute_dtype
        self.pin_memory = pin_memory
        self.state_dtype = state_dtype
        self.master_dtype = master_dtype
        self.grad_hold = gradient_hold(
            master_dtype,
            grad_dtype,
            clipping=clipping,
            bf16_compute=compute_dtype == torch.bfloat16,
        )
        self._patterns = [re.compile(p, re.IGNORECASE) for p in no_decay]
        self._decay_1d = decay_1d
        self._shard = shard
        self._device_blocks, self._device = frozenset(device_blocks), device
        self._owners = _owners_by_param(structure.causal_lm)
        self._meta: dict[int, nn.Parameter] = {}
        self._taken: set[int] = set()
        prefix = _prefixes(structure)
        names = {id(m): n for n, m in structure.causal_lm.named_modules()}
        vision_roots = [(key, m, names[id(m)]) for key, m in (vision or {}).items()]
        # what the image features never reach stays frozen (PyTorch: no gradient, no update)
        unused = unused_vision_params(structure) if vision_roots else set()
        self.vision_unused = sum(
            p.numel() for _, m, _ in vision_roots for p in m.parameters() if id(p) in unused
        )
        self.vision = self._build("vision", vision_roots, unused) if vision_roots else None
        self.embed = self._build("embed", [("embed", structure.embed, prefix["embed"])])
        self.layers = [
            self._build(f"layer.{i}", [("layer", layer, f"{prefix['layers']}.{i}")])
            for i, layer in enumerate(structure.layers)
        ]
        # A tied lm_head weight is already taken by the embedding block; its bias (if any) is not.
        self.head = self._build(
            "head",
            [
                ("norm", structure.final_norm, prefix["norm"]),
                ("lm_head", structure.lm_head, prefix["lm_head"]),
            ],
        )
        self.grad_pool: LandingPool | None = None
        if pool_buffers([b.numel for b in self.blocks], self.grad_hold):
            self.grad_pool = LandingPool(max(b.numel for b in self.blocks), pin=pin_memory)
            for block in self.blocks:
                block.grad_pool = self.grad_pool

    @property
    def blocks(self) -> list[ParamBlock]:
        """All blocks in forward order: (trained vision parts,) embedding, layers, head."""
        first = [self.vision] if self.vision is not None else []
        return [*first, self.embed, *self.layers, self.head]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.blocks)

    def host_bytes(self) -> int:
        pool = self.grad_pool.buffers() if self.grad_pool is not None else []
        return sum(b.host_bytes() for b in self.blocks) + sum(2 * t.numel() for t in pool)

    def _build(
        self, name: str, roots: list[tuple[str, nn.Module, str]], skip: set[int] | None = None
    ) -> ParamBlock:
        block = self._block(name, roots, skip)
        if name in self._device_blocks:
            assert self._device is not None, name
            block.to_device(self._device)  # its host copies are freed now
        return block

    def _block(
        self, name: str, roots: list[tuple[str, nn.Module, str]], skip: set[int] | None
    ) -> ParamBlock:
        found: list[tuple[str, str, str, nn.Parameter]] = []
        for root_key, root, prefix in roots:
            for pname, p in root.named_parameters():
                if skip and id(p) in skip:
                    continue  # stays in the HF model, frozen
                if id(p) in self._taken:
                    continue  # tied: already stored in an earlier block
                self._taken.add(id(p))
                found.append((root_key, pname, f"{prefix}.{pname}", p))
        found.sort(key=lambda item: not self._decays(item[2], item[3]))  # stable: decayed first
        entries, offset, decay_numel = [], 0, 0
        for root_key, pname, full, p in found:
            decay = self._decays(full, p)
            entries.append(
                ParamEntry(
                    owners=self._owners[id(p)],
                    root=root_key,
                    name=pname,
                    full_name=full,
                    shape=p.shape,
                    offset=offset,
                    decay=decay,
                )
            )
            offset += p.numel()
            decay_numel += p.numel() if decay else 0
        master = host_zeros(offset, torch.float32, pin=self._pin_master and self._shard is None)
        for entry, (_, _, _, p) in zip(entries, found, strict=True):
            master[entry.offset : entry.offset + entry.numel].copy_(p.detach().reshape(-1))
            self._to_meta(entry, p)
        if self._shard is not None:  # this rank's part only
            return self._shard(
                master,
                name=name,
                entries=entries,
                decay_numel=decay_numel,
                state_dtype=self.state_dtype,
                master_dtype=self.master_dtype,
                bf16=self.compute_dtype == torch.bfloat16,
                grad_hold=self.grad_hold,
            )
        bf16_master = self.master_dtype == "bf16"
        block = ParamBlock.with_states(
            name=name,
            entries=entries,
            numel=offset,
            decay_numel=decay_numel,
            master=bf16_master_of(master, pin=self.pin_memory) if bf16_master else master,
            state_dtype=self.state_dtype,
        )
        if bf16_master:  # the master is the streamed copy; the gradient lands beside it
            for key, tensor in allocate_hold(offset, self.grad_hold, pin=self.pin_memory).items():
                setattr(block, key, tensor)
        elif self.compute_dtype == torch.bfloat16:
            block.shadow = host_zeros(offset, torch.bfloat16, pin=self.pin_memory)
            block.refresh_shadow()
        else:
            block.grad = host_zeros(offset, torch.float32, pin=self.pin_memory)
        return block

    @property
    def _pin_master(self) -> bool:
        # In fp32 compute the master itself is the host-to-device source: pin it. (A bf16
        # master is made from this one, pinned, and this one is freed.)
        return self.pin_memory and self.compute_dtype == torch.float32

    def _decays(self, full_name: str, p: torch.Tensor) -> bool:
        if p.dim() < 2 and not self._decay_1d:
            return False
        return not any(pat.search(full_name) for pat in self._patterns)

    def _to_meta(self, entry: ParamEntry, p: nn.Parameter) -> None:
        meta = nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
        )
        self._meta[id(entry)] = meta
        self._taken.add(id(meta))  # a tied owner now holds the meta tensor: don't store it again
        for module, attr in entry.owners:
            setattr(module, attr, meta)

    @contextmanager
    def bound(self, dtype: torch.dtype = torch.float32) -> Iterator[PreTrainedModel]:
        """The HF model with its current weights bound in, as `dtype` (fp32 or bf16).

        fp32 binds the master itself (a cast copy of a bf16 master); bf16 binds the shadow, a bf16
        master itself, or a cast copy of an fp32 master in fp32 compute;
        blocks of the GPU tier are copied to the host first. Each parameter gets a storage of
        its own over the block's memory (no copy), so `save_pretrained` sees separate tensors
        rather than views of one shared buffer. Call
        only between steps, with all updates applied (the shadow holds gradients mid-step).
        The skeleton is weightless again afterwards. A vision-language model's frozen vision
        modules (never in the store) are cast to `dtype` meanwhile.
        """
        frozen = [
            (m, n, p)
            for vision in self.structure.vision.values()
            for m in vision.modules()
            for n, p in m._parameters.items()
            if p is not None and p.device.type != "meta" and p.dtype != dtype
        ]
        for m, n, p in frozen:
            m._parameters[n] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for block in self.blocks:
            flat = block.master
            if dtype == torch.bfloat16:
                flat = block.shadow if block.shadow is not None else block.master.bfloat16()
            flat = flat.cpu().to(dtype)  # a GPU-tier block's weights come back (sync point)
            for entry in block.entries:
                param = nn.Parameter(_own_storage(block.view(flat, entry)), requires_grad=False)
                for module, attr in entry.owners:
                    setattr(module, attr, param)
        try:
            yield self.structure.causal_lm
        finally:
            for m, n, p in frozen:
                m._parameters[n] = p
            for block in self.blocks:
                for entry in block.entries:
                    for module, attr in entry.owners:
                        setattr(module, attr, self._meta[id(entry)])


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """The same memory as `view`, as a tensor whose storage covers just that memory."""
    flat = view.reshape(-1)
    if flat.dtype == torch.bfloat16:
        return (
            torch.from_numpy(flat.view(torch.int16).numpy()).view(torch.bfloat16).view(view.shape)
        )
    return torch.from_numpy(flat.numpy()).view(view.shape)


def _owners_by_param(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))
    return owners


def _prefixes(structure: ModelStructure) -> dict[str, str]:
    names = {id(m): n for n, m in structure.causal_lm.named_modules()}
    return {
        "embed": names[id(structure.embed)],
        "layers": names[id(structure.layers)],
        "norm": names[id(structure.final_norm)],
        "lm_head": names[id(structure.lm_head)],
    }
