"""Where a bf16 master's gradient waits for its update on the host (`optimizer.grad_dtype`).

An fp32 master's gradient lands in its bf16 shadow (store/master.py): it costs nothing. A bf16
master is itself the streamed copy, so its gradient needs host bytes of its own between the
block's backward and its update. How many depends on whether the update can run at once:

- clipping on (exact global-norm clipping, the default): every update waits for the last
  backward, so every block's gradient is held at the same time, in `optimizer.grad_dtype`:
  - "bf16": a pinned bf16 landing per block, 2 B/param;
  - "int8": a pinned landing of int8 codes per block plus one fp32 unit per GRAD_BLOCK values,
    1.002 B/param. The device quantizes the fp32 gradient (after taking its exact norm) with
    stochastic rounding, code = floor(g / unit + u), u uniform in [0, 1) and
    unit = block absmax / 127, so E[code * unit] = g: the update reads an unbiased gradient
    with an error below one unit per element. Half the device-to-host bytes of bf16.
- clipping off (`max_grad_norm: 0`): the layer-major schedule knows a block's gradient is
  complete after its backward visit and submits its update then; the gradient lands in one of
  POOL_LANDINGS bf16 buffers shared by all blocks (each the size of the largest block) and the
  buffer is free again once the update has read it. No gradient is held per block ("pool").

`gradient_hold` names the case; `hold_buffers` and `pool_buffers` give the pinned bytes the
store allocates and the planner counts (planning/host_memory.py), from the same code.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from megatrain.choices import GRAD_DTYPES
from megatrain.store.memory import host_zeros
from megatrain.store.states import QUANT_BLOCK, lowbias32, rounding_key

if TYPE_CHECKING:
    from megatrain.store.blocks import ParamBlock

GRAD_BLOCK = QUANT_BLOCK
"""Values per fp32 unit of an int8 gradient (csrc/adamw.c reads g_unit[i / QBLOCK])."""
GRAD_CHUNK = 4096 * GRAD_BLOCK
"""Values quantized per pass on the device (bounds the pass's temporaries to ~100 MB)."""
POOL_LANDINGS = 2
"""bf16 landing buffers shared by the blocks when clipping is off: the backward waits for a
free one only when the CPU updates lag two blocks behind it (the step waits for them anyway)."""
INT8_LEVELS = 127

HOLDS = ("shadow", "fp32", "bf16", "int8", "pool")
"""How a block's gradient waits for its update: in the fp32 master's bf16 shadow (free), an fp32
landing (fp32 compute), a bf16 or int8 landing of a bf16 master, or a shared pool."""


def check_grad_dtype(grad_dtype: str) -> None:
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(
            f"optimizer.grad_dtype must be one of {', '.join(GRAD_DTYPES)}, got {grad_dtype!r}"
        )


def gradient_hold(
    master_dtype: str, grad_dtype: str, *, clipping: bool, bf16_compute: bool = True
) -> str:
    """Which of HOLDS a store with these settings uses (see the module docstring)."""
    check_grad_dtype(grad_dtype)
    if not bf16_compute:
        return "fp32"
    if master_dtype == "fp32":
        return "shadow"
    return grad_dtype if clipping else "pool"


def num_grad_blocks(numel: int) -> int:
    return -(-numel // GRAD_BLOCK)


def hold_buffers(numel: int, hold: str) -> list[int]:
    """Pinned bytes a block of `numel` parameters keeps for its gradient (one entry a buffer)."""
    if hold == "fp32":
        return [4 * numel]
    if hold == "bf16":
        return [2 * numel]
    if hold == "int8":
        return [numel, 4 * num_grad_blocks(numel)]
    assert hold in ("shadow", "pool"), hold
    return []


def pool_buffers(numels: list[int], hold: str) -> list[int]:
    """Pinned bytes of the shared landings of a store whose blocks have `numels` parameters."""
    if hold != "pool" or not numels:
        return []
    return [2 * max(numels)] * POOL_LANDINGS


def allocate_hold(numel: int, hold: str, *, pin: bool) -> dict[str, torch.Tensor]:
    """A block's own gradient buffers as ParamBlock fields (`grad`, and `grad_unit` for int8)."""
    if hold == "fp32":
        return {"grad": host_zeros(numel, torch.float32, pin=pin)}
    if hold == "bf16":
        return {"grad": host_zeros(numel, torch.bfloat16, pin=pin)}
    if hold == "int8":
        return {
            "grad": host_zeros(numel, torch.int8, pin=pin),
            "grad_unit": host_zeros(num_grad_blocks(numel), torch.float32, pin=pin),
        }
    assert hold in ("shadow", "pool"), hold
    return {}


class LandingPool:
    """POOL_LANDINGS bf16 buffers the blocks' gradients land in when clipping is off: `take`
    (the backward, before its copy) waits for a free one; `give` (after the update) frees it."""

    def __init__(self, numel: int, *, pin: bool, count: int = POOL_LANDINGS) -> None:
        self.numel = numel
        self._free = [host_zeros(numel, torch.bfloat16, pin=pin) for _ in range(count)]
        self._taken: dict[int, torch.Tensor] = {}  # by data pointer: the whole buffer
        self._cond = threading.Condition()

    def take(self, numel: int) -> torch.Tensor:
        assert numel <= self.numel, (numel, self.numel)
        with self._cond:
            while not self._free:
                self._cond.wait()  # sync point (host): an update frees a landing
            buffer = self._free.pop()
            self._taken[buffer.data_ptr()] = buffer
            return buffer[:numel]

    def give(self, landing: torch.Tensor) -> None:
        with self._cond:
            self._free.append(self._taken.pop(landing.data_ptr()))
            self._cond.notify()

    def buffers(self) -> list[torch.Tensor]:
        return list(self._free)


# ---------------------------------------------------------------- int8 gradients


def quantize_gradient_(
    src: torch.Tensor, codes: torch.Tensor, units: torch.Tensor, key: int
) -> None:
    """Write `src` (a block's gradient, any float dtype, on any device) into int8 `codes` and
    fp32 `units` (one per GRAD_BLOCK values) with stochastic rounding (module docstring).

    The uniform draws come from one generator per GRAD_CHUNK of the block, seeded from `key`
    (store/states.py rounding_key of (block, step, "g")) and the chunk's index: a run repeats
    exactly on the same device, and a resumed run draws what the uninterrupted one drew."""
    n = src.numel()
    assert codes.numel() >= n and units.numel() >= num_grad_blocks(n)
    for c, lo in enumerate(range(0, n, GRAD_CHUNK)):
        hi = min(lo + GRAD_CHUNK, n)
        x = src[lo:hi].float()
        pad = (-x.numel()) % GRAD_BLOCK
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, GRAD_BLOCK)
        unit = blocks.abs().amax(dim=1) / INT8_LEVELS
        gen = torch.Generator(device=src.device)
        gen.manual_seed(lowbias32((key ^ lowbias32(c)) & 0xFFFFFFFF))
        u = torch.rand(blocks.shape, generator=gen, device=src.device)
        safe = torch.where(unit > 0, unit, torch.ones_like(unit))
        q = torch.floor(blocks / safe[:, None] + u).clamp_(-INT8_LEVELS, INT8_LEVELS)
        codes[lo:hi].copy_(q.view(-1)[: hi - lo])
        units[lo // GRAD_BLOCK : lo // GRAD_BLOCK + unit.numel()].copy_(unit)


def gradient_key(block: ParamBlock) -> int:
    """The key of a block's gradient quantization in its coming update."""
    return rounding_key(block.rounding_name, block.step, "g")


def int8_views(stage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, units) of a block's int8 gradient on the device, inside its bf16 staging buffer
    (2 bytes a value: room for a byte of code and the units after them), or new tensors when a
    tiny block leaves no room."""
    n = stage.numel()
    start = -(-n // 4) * 4  # the units' first byte, fp32-aligned
    if start + 4 * num_grad_blocks(n) > 2 * n:
        codes = torch.empty(n, dtype=torch.int8, device=stage.device)
        return codes, torch.empty(num_grad_blocks(n), dtype=torch.float32, device=stage.device)
    raw = stage.view(torch.int8)
    return raw[:n], raw[start : start + 4 * num_grad_blocks(n)].view(torch.float32)


def dequantize_gradient(codes: torch.Tensor, units: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Values lo..hi of an int8 gradient in fp32: code * unit, one rounding, as the C kernel."""
    index = torch.arange(lo, hi, device=codes.device) // GRAD_BLOCK
    return codes[lo:hi].float() * units[index]


def held_gradient(block: ParamBlock, lo: int, hi: int) -> torch.Tensor:
    """Values lo..hi of the gradient a block holds for its update, in fp32."""
    if block.grad_unit is not None:
        return dequantize_gradient(block.grad_landing, block.grad_unit, lo, hi)
    return block.grad_landing[lo:hi].float()
