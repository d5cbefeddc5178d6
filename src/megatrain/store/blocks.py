"""One flat host block per streamed unit: the embedding, each decoder layer, the head.

Layout of a block's flat tensors (all the same length `numel`):

    [ decayed parameters ... | parameters without weight decay ... ]

so the optimizer applies weight decay to one contiguous range and skips the other. Each entry
records where one named parameter of the block's module lives in that layout.

Host buffers per block:
- `master`  fp32 master weights (pageable; pinned in fp32 compute on CUDA, where it is the copy
            source), or bf16 master weights (`optimizer.master_dtype: bf16`, store/master.py:
            pinned, the copy source itself, no shadow)
- `exp_avg`, `exp_avg_sq`  AdamW m and v in the block's `state_dtype` (store/states.py): fp32,
            bf16, or int8 / int4 (uint8 codes, int4 two a byte, with one fp32 absmax per
            quantization block in `exp_avg_scale`, `exp_avg_sq_scale`)
- `shadow`  bf16 copy of the weights, pinned: the host-to-device source in bf16 compute. Between
            a layer's backward and its optimizer update it holds that layer's bf16 gradient
            instead (the weights are not needed then); the update reads the gradient and writes
            the new weights into the same place. So gradients need no host memory of their own.
- `grad`    fp32 gradient, only in fp32 compute (where there is no bf16 shadow to reuse), or the
            gradient landing of a bf16 master (whose streamed copy holds the weights): bf16, or
            int8 codes with `grad_unit`, or with clipping off one of the store's shared landings
            (`grad_pool`) from the block's backward to its update (store/grads.py).

A block of the GPU tier (`to_device`) holds all of these on the compute device instead, for the
whole run: fp32 master, m, v, and (bf16 compute) the shadow as the layer's device weights, which
receive its bf16 gradient between its backward and its update as the host shadow does; an fp32
gradient only in fp32 compute. Its checkpoint files are the same (engine/tier.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from megatrain.native import load_adamw_kernel
from megatrain.store.memory import host_zeros
from megatrain.store.states import allocate_states


@dataclass
class ParamEntry:
    owners: list[tuple[nn.Module, str]]  # (module, attribute) pairs of the HF skeleton holding it
    root: str  # which root module of the block: "embed", "layer", "norm" or "lm_head"
    name: str  # dotted name inside that root module (e.g. "mlp.down_proj.weight")
    full_name: str  # dotted name in the causal LM (e.g. "model.layers.3.mlp.down_proj.weight")
    shape: torch.Size
    offset: int
    decay: bool
    requires_grad: bool = True

    @property
    def numel(self) -> int:
        return self.shape.numel()


_Block = TypeVar("_Block", bound="ParamBlock")


@dataclass
class ParamBlock:
    name: str  # "embed", "layer.<i>", "head"
    entries: list[ParamEntry]
    numel: int
    decay_numel: int  # entries [0, decay_numel) take weight decay
    master: torch.Tensor = field(repr=False)
    exp_avg: torch.Tensor = field(repr=False)
    exp_avg_sq: torch.Tensor = field(repr=False)
    shadow: torch.Tensor | None = field(default=None, repr=False)
    grad: torch.Tensor | None = field(default=None, repr=False)
    step: int = 0  # optimizer steps applied to this block
    state_dtype: str = "fp32"  # layout of exp_avg / exp_avg_sq: store/states.py STATE_DTYPES
    exp_avg_scale: torch.Tensor | None = field(default=None, repr=False)  # int8, int4
    exp_avg_sq_scale: torch.Tensor | None = field(default=None, repr=False)  # int8, int4
    grad_unit: torch.Tensor | None = field(default=None, repr=False)  # an int8 gradient's units
    grad_pool: Any = field(default=None, repr=False)  # store/grads.py LandingPool, clipping off

    @classmethod
    def with_states(
        cls: type[_Block], *, master: torch.Tensor, state_dtype: str, **fields: Any
    ) -> _Block:
        """A block over `master` with zeroed AdamW states in `state_dtype`'s layout
        (store/states.py allocate_states); `fields`: the other dataclass fields."""
        states = allocate_states(master.numel(), state_dtype)
        return cls(
            master=master,
            exp_avg=states["exp_avg"],
            exp_avg_sq=states["exp_avg_sq"],
            state_dtype=state_dtype,
            exp_avg_scale=states.get("exp_avg_scale"),
            exp_avg_sq_scale=states.get("exp_avg_sq_scale"),
            **fields,
        )

    @property
    def source(self) -> torch.Tensor:
        """What the device copies from: the bf16 shadow, or the master (fp32 in fp32 compute,
        or a bf16 master)."""
        return self.shadow if self.shadow is not None else self.master

    @property
    def master_dtype(self) -> str:
        """Layout of the master: "fp32", or "bf16" (store/master.py; then it is the source)."""
        return "bf16" if self.master.dtype == torch.bfloat16 else "fp32"

    @property
    def rounding_name(self) -> str:
        """What keys this block's bf16 stochastic rounding (store/states.py rounding_keys)."""
        return self.name

    @property
    def grad_landing(self) -> torch.Tensor:
        """Where this block's gradient is copied to from the device (see module docstring)."""
        if self.grad is not None:
            return self.grad
        assert self.shadow is not None, f"{self.name}: no gradient landing taken"
        return self.shadow

    def take_landing(self) -> None:
        """Clipping off, bf16 master: take a shared landing for this step's gradient (waits
        for a free one)."""
        if self.grad_pool is not None:
            assert self.grad is None, f"{self.name}: landing already taken"
            self.grad = self.grad_pool.take(self.numel)

    def release_landing(self) -> None:
        """After the update: give a shared landing back."""
        if self.grad_pool is not None and self.grad is not None:
            self.grad_pool.give(self.grad)
            self.grad = None

    def view(self, flat: torch.Tensor, entry: ParamEntry) -> torch.Tensor:
        return flat[entry.offset : entry.offset + entry.numel].view(entry.shape)

    def refresh_shadow(self) -> None:
        """Rewrite the bf16 shadow from the master (after a skipped update, at load)."""
        if self.shadow is not None:
            to_bf16_(self.shadow, self.master)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer states as stored (what a checkpoint holds besides the master)."""
        states = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.exp_avg_scale is not None and self.exp_avg_sq_scale is not None:
            states.update(exp_avg_scale=self.exp_avg_scale, exp_avg_sq_scale=self.exp_avg_sq_scale)
        return states

    def host_bytes(self) -> int:
        total = 0
        own = None if self.grad_pool is not None else self.grad  # a shared landing: the pool's
        for t in (self.master, *self.state_tensors().values(), self.shadow, own, self.grad_unit):
            if t is not None and t.device.type == "cpu":
                total += t.numel() * t.element_size()
        return total

    def to_device(self, device: torch.device) -> None:
        """Move master, m, v (with their scales) and shadow to `device` for good; in fp32
        compute (no shadow to land in) with an fp32 gradient there.

        The host copies are freed. On the CPU the tensors stay where they are (the GPU tier's
        code path, run on the CPU).
        """
        self.master = self.master.to(device)
        self.exp_avg = self.exp_avg.to(device)
        self.exp_avg_sq = self.exp_avg_sq.to(device)
        if self.exp_avg_scale is not None and self.exp_avg_sq_scale is not None:
            self.exp_avg_scale = self.exp_avg_scale.to(device)
            self.exp_avg_sq_scale = self.exp_avg_sq_scale.to(device)
        if self.shadow is not None:
            self.shadow = self.shadow.to(device)
        if self.shadow is not None or (self.grad is not None and self.grad.device == device):
            return
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=device)

    def to_host(self, *, pin: bool) -> None:
        """Undo `to_device`: the host store's layout again (a smaller GPU tier). The master is
        pinned where it is the copy source (fp32 compute), the bf16 shadow always when `pin`;
        fp32 compute gets its host gradient back, bf16 compute none (the shadow receives it)."""
        bf16 = self.shadow is not None
        self.master = _host_copy(self.master, pin=pin and not bf16)
        self.exp_avg = _host_copy(self.exp_avg, pin=False)
        self.exp_avg_sq = _host_copy(self.exp_avg_sq, pin=False)
        if self.exp_avg_scale is not None and self.exp_avg_sq_scale is not None:
            self.exp_avg_scale = _host_copy(self.exp_avg_scale, pin=False)
            self.exp_avg_sq_scale = _host_copy(self.exp_avg_sq_scale, pin=False)
        if self.shadow is not None:
            self.shadow = _host_copy(self.shadow, pin=pin)
        self.grad = None if bf16 else host_zeros(self.numel, torch.float32, pin=pin)


def _host_copy(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """A host copy of `t` in the store's kind of host buffer (huge pages; page-locked if `pin`)."""
    out = host_zeros(t.numel(), t.dtype, pin=pin)
    out.copy_(t.reshape(-1))
    return out.view(t.shape)


def to_bf16_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (bf16) <- src (fp32) rounded to nearest even; the C kernel's parallel cast if built."""
    lib = load_adamw_kernel()
    on_host = src.device.type == "cpu" and dst.device.type == "cpu"
    if lib is None or not (on_host and src.is_contiguous() and dst.is_contiguous()):
        dst.copy_(src)
        return
    lib.mt_to_bf16(src.data_ptr(), dst.data_ptr(), src.numel(), torch.get_num_threads())
