"""AdamW state layouts of the host store: fp32, bf16 and block-wise 8-bit and 4-bit m and v.

`optimizer.state_dtype` picks one layout per store; every block records its own
(`ParamBlock.state_dtype`), so an optimizer (the C kernel, the torch reference, a device-side
tier) reads the layout from the block it updates. Bytes of m + v per parameter:

- fp32: 8. Exact AdamW.
- bf16: 4. m and v are stored in bf16 with stochastic rounding: with beta2 = 0.999 a step
  changes v by ~0.1%, less than half a bf16 ulp (0.2-0.4%), so round-to-nearest would freeze v
  (and bias m); stochastic rounding keeps both unbiased. The random bits are a hash of (block
  name, step, m or v, element index): the same run rounds identically every time, a resumed
  run continues exactly, and the C kernel and the torch reference agree bit for bit.
- int8: 2 + 8 / QUANT_BLOCK. 8-bit Adam (Dettmers et al., arXiv 2110.02861): each block of
  QUANT_BLOCK elements stores one fp32 absmax per state and 8-bit codes into the paper's
  dynamic (non-linear) quantization map, signed for m and unsigned for v (v >= 0, so the sign
  bit buys precision). The map keeps ~7 decades of relative range (values down to ~3e-7 of
  the absmax): a linear map would zero every v far below its block's largest, and the update
  m / (sqrt(v) + eps) would explode there. Codes round to the nearest map value (as in the
  paper): the code is the number of midpoints between neighbouring map values that lie below
  the normalised value, so every implementation that compares against the same float32
  midpoints picks the same code. Block size 2048, as in the paper.
- int4: 1 + 8 / 128. 4-bit AdamW (Li et al., arXiv 2309.01507): blocks of 128, two codes a
  byte, a signed dynamic-exponent map for m and a linear map without zero for v; its layout,
  maps and torch reference are store/int4.py's.

A block's quantization blocks start at its element 0 and may straddle its decay boundary: the
compressed kernels update a whole block in one call.
"""

from __future__ import annotations

import zlib
from functools import cache

import torch

from megatrain.choices import STATE_DTYPES
from megatrain.store.int4 import allocate_int4_states, int4_nbytes

QUANT_BLOCK = 2048
_MASK32 = 0xFFFFFFFF


def check_state_dtype(state_dtype: str) -> None:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"optimizer.state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}"
        )


def num_quant_blocks(numel: int) -> int:
    return -(-numel // QUANT_BLOCK)


def state_nbytes(numel: int, state_dtype: str) -> int:
    """Host bytes of m and v (with their int8 scales) for a block of `numel` parameters."""
    check_state_dtype(state_dtype)
    if state_dtype == "fp32":
        return 8 * numel
    if state_dtype == "bf16":
        return 4 * numel
    if state_dtype == "int4":
        return int4_nbytes(numel)
    return 2 * numel + 2 * 4 * num_quant_blocks(numel)


def state_bytes_per_param(state_dtype: str) -> float:
    """m + v bytes per parameter, the scales amortised over full quantization blocks (2048 is
    a multiple of int4's 128)."""
    return state_nbytes(QUANT_BLOCK, state_dtype) / QUANT_BLOCK


def allocate_states(numel: int, state_dtype: str) -> dict[str, torch.Tensor]:
    """Zero m and v of a block in `state_dtype`, as ParamBlock keyword arguments."""
    from megatrain.store.memory import host_zeros

    check_state_dtype(state_dtype)
    if state_dtype in ("fp32", "bf16"):
        dtype = torch.float32 if state_dtype == "fp32" else torch.bfloat16
        return {"exp_avg": host_zeros(numel, dtype), "exp_avg_sq": host_zeros(numel, dtype)}
    if state_dtype == "int4":
        return allocate_int4_states(numel)
    return {
        "exp_avg": host_zeros(numel, torch.uint8).fill_(zero_code(signed=True)),
        "exp_avg_sq": host_zeros(numel, torch.uint8).fill_(zero_code(signed=False)),
        "exp_avg_scale": host_zeros(num_quant_blocks(numel), torch.float32),
        "exp_avg_sq_scale": host_zeros(num_quant_blocks(numel), torch.float32),
    }


# ---------------------------------------------------------------- 8-bit dynamic quantization


@cache
def dynamic_map(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(256 map values, 255 midpoints), float32, ascending: the dynamic map of 8-bit Adam.

    The construction of bitsandbytes' `create_dynamic_map` (7 exponent bits, 8 bits in all):
    for decade i = 0..6, the means of 2^i (signed) or 2^(i+1) (unsigned) equal steps of
    [0.1, 1], times 10^(i-6); negated too when signed; plus 0 and 1.
    """
    values: list[float] = [0.0, 1.0]
    for i in range(7):
        items = 2**i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1.0, items + 1, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += means + ([-x for x in means] if signed else [])
    ordered = torch.tensor(sorted(values), dtype=torch.float64)
    assert ordered.numel() == 256
    mids = ((ordered[:-1] + ordered[1:]) / 2).float()
    qmap = ordered.float()
    assert bool((qmap[1:] > qmap[:-1]).all()) and bool((mids[1:] > mids[:-1]).all())
    return qmap, mids


@cache
def quantize_table(signed: bool) -> torch.Tensor:
    """The C kernel's lookup for quantizing (csrc/adamw.c `quantize`): int32[65536], indexed by
    a float32's top 16 bits. Entry k holds, in bits 0-7, the code (number of midpoints below)
    of the lowest float whose top 16 bits are k; in bit 8, whether the next midpoint has those
    top bits too; in bits 16-31, that midpoint's low 16 bits. The kernel then compares x's low
    bits with it, an integer comparison: floats sharing their top 16 bits (< 0.8% of its values
    wide) order as their low bits do (reversed for negatives), and no such range holds two
    midpoints (the map's gaps are wider), which is checked here. One 32-bit gather an element,
    so the kernel's requantizing loop vectorizes (vector gathers load 32-bit lanes): the int8
    update ran 0.71 Gparams/s on 1 thread and 1.33 on 2 of an AMD EPYC (2026-11-27), where a
    byte table of codes and a gather of the midpoint (a scalar loop) ran 0.45 and 0.86.
    """
    mids = dynamic_map(signed)[1]
    prefix = torch.arange(1 << 16, dtype=torch.int64) << 16
    negative = prefix >= 1 << 31  # sign-magnitude: the lowest negative float has low bits 1
    lowest = _float32_of(prefix | torch.where(negative, 0xFFFF, 0))
    lowest[0xFF80] = float("-inf")  # the only float of that range that is not a NaN
    highest = _float32_of(prefix | torch.where(negative, 0, 0xFFFF))
    start = torch.searchsorted(mids, lowest)
    assert int((torch.searchsorted(mids, highest) - start).max()) <= 1
    bits = mids.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the midpoints' patterns
    nxt = bits[start.clamp(max=len(mids) - 1)]
    shares = (start < len(mids)) & (nxt >> 16 == torch.arange(1 << 16))
    entry = start | shares.to(torch.int64) << 8 | (nxt & 0xFFFF) << 16
    return torch.where(entry >= 1 << 31, entry - (1 << 32), entry).to(torch.int32)


def _float32_of(bits: torch.Tensor) -> torch.Tensor:
    """Floats of 32-bit patterns held in int64; NaN patterns become 0 (any code will do)."""
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return signed.view(torch.float32).nan_to_num(nan=0.0)


def zero_code(*, signed: bool) -> int:
    """The code of 0.0: what zero-initialised states hold."""
    return int((dynamic_map(signed)[0] == 0).nonzero().item())


def quantize_blockwise(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 absmax per QUANT_BLOCK) of a flat fp32 tensor: nearest map value."""
    blocks = _padded_blocks(x)
    absmax = blocks.abs().amax(dim=1)
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalized = (blocks / divisor[:, None]).reshape(-1)[: x.numel()]
    mids = dynamic_map(signed)[1].to(x.device)
    return torch.searchsorted(mids, normalized).to(torch.uint8), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool
) -> torch.Tensor:
    """fp32 values of codes: map value times the block's absmax (one rounding)."""
    qmap = dynamic_map(signed)[0].to(codes.device)
    scale = absmax.repeat_interleave(QUANT_BLOCK)[: codes.numel()]
    return qmap[codes.long()] * scale


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    pad = num_quant_blocks(x.numel()) * QUANT_BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QUANT_BLOCK)


# ---------------------------------------------------------------- bf16 stochastic rounding


def lowbias32(x: int) -> int:
    """A 32-bit integer hash (C. Wellons' lowbias32); the C kernel has the same."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def rounding_keys(block_name: str, step: int) -> tuple[int, int]:
    """The stochastic-rounding keys of m and of v for one update of one block."""
    return rounding_key(block_name, step, "m"), rounding_key(block_name, step, "v")


def rounding_key(block_name: str, step: int, tensor: str) -> int:
    """The stochastic-rounding key of one tensor ("m", "v"; "p": a bf16 master,
    store/master.py) for one update of one block."""
    base = lowbias32(zlib.crc32(block_name.encode()) ^ lowbias32(step & _MASK32))
    return lowbias32(base ^ ord(tensor))


def bf16_stochastic(x: torch.Tensor, key: int, start: int = 0) -> torch.Tensor:
    """x (fp32, elements start, start+1, ... of a block) rounded to bf16 stochastically.

    Adds 16 random bits to the fp32 bit pattern below the bf16 mantissa and truncates: the
    magnitude rounds up with probability equal to the dropped fraction, so E[round(x)] = x.
    Infinities stay; NaN stays NaN. Bit for bit what csrc/adamw.c's bf16_round_stochastic does.
    """
    index = torch.arange(start, start + x.numel(), dtype=torch.int64, device=x.device)
    bits = _lowbias32_t((index & _MASK32) ^ _lowbias32_t((index >> 32) ^ key))
    u = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    rounded = (u + (bits >> 16)) >> 16
    magnitude = u & 0x7FFFFFFF
    rounded = torch.where(magnitude >= 0x7F800000, u >> 16, rounded)
    rounded = torch.where(magnitude > 0x7F800000, rounded | 0x40, rounded)
    rounded = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded)
    return rounded.to(torch.int16).view(torch.bfloat16)


def _lowbias32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 in int64, split so no product overflows 2^63."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32
