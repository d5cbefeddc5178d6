"""The 4-bit AdamW state layout (`optimizer.state_dtype: int4`): codes, maps and the reference.

4-bit AdamW as in Li et al. 2023, "Memory Efficient Optimizers with 4-bit States" (arXiv
2309.01507): small quantization blocks of INT4_BLOCK = 128 values (the paper's block for m),
each with its own fp32 absmax per state, and one 4-bit code per value, two codes a byte.

- m: signed, the paper's dynamic-exponent map ("DE"; bitsandbytes' `create_dynamic_map` with 3
  exponent bits and 4 bits in all): 0, +-0.0055, +-0.0325, +-0.0775, +-0.2125, +-0.4375,
  +-0.6625, +-0.8875 and 1.0, times the block's absmax of |m|. Exact zero is a code.
- v: unsigned, the paper's linear map without zero, (k + 1) / 16 for k = 0..15 times the
  block's absmax of v. No code means 0: a v far below its block's largest rounds up to 1/16
  of it, never down to zero (the paper's "zero-point problem": a v stored as 0 under an m that
  is not makes the update m / (sqrt(v) + eps) explode). So every stored v is at least 1/16 of
  its block's largest: an element whose v is below 1/32 of its block's largest takes a step
  sqrt(absmax / 16 / v) times smaller than exact AdamW's, never a larger one. The paper's
  rank-1 normalisation of v needs a tensor's 2-D shape and a second pass over it; blocks of
  128 keep the update one pass over memory and limit how uneven one block's values can be.

Rounding is to the nearest map value, as for int8 (store/states.py): the code is the number of
the 15 float32 midpoints between neighbouring map values that lie below the normalised value
(`torch.searchsorted`; NaN sorts above all of them), which csrc/adamw.c `mt_adamw_int4` computes
without a table: for m, integer comparisons of float32 patterns with its 8 positive midpoints
(the signed map is symmetric below its top value); for v, ceil(16 x - 1.5) (the linear map).

Packing: quantization block b owns bytes [64 b, 64 b + 64) of a state's codes; byte j holds the
code of the block's value j in its low nibble and of its value 64 + j in its high nibble (both
halves read and write contiguous runs, so the kernel's loops vectorize). A partial last block
counts whole (64 bytes, one scale each); its values past the end hold the code of 0 (m) or of
the smallest value (v). A block's quantization blocks start at its element 0; shards (store/
shard.py) are whole multiples of 2048 values, so of INT4_BLOCK, and their codes and scales
concatenate into the whole block's.

Bytes of m + v per parameter: 2 x (1/2 + 4 / 128) = 1.0625.
"""

from __future__ import annotations

from functools import cache

import torch

INT4_BLOCK = 128
INT4_HALF = INT4_BLOCK // 2  # bytes of codes per quantization block and state


def num_int4_blocks(numel: int) -> int:
    return -(-numel // INT4_BLOCK)


def int4_nbytes(numel: int) -> int:
    """Host bytes of m and v (codes and fp32 scales) for a block of `numel` parameters."""
    return 2 * (INT4_HALF + 4) * num_int4_blocks(numel)


@cache
def int4_map(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(16 map values, 15 midpoints), float32, ascending: m's signed dynamic-exponent map or
    v's linear map without zero (module docstring). Built in float64, rounded once."""
    if signed:
        values = [0.0, 1.0]
        for i in range(3):  # exponent 10^(i - 2), 2^i fraction steps of [0.1, 1]
            bounds = torch.linspace(0.1, 1.0, 2**i + 1, dtype=torch.float64)
            means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 2)).tolist()
            values += means + [-x for x in means]
    else:
        values = [(k + 1) / 16 for k in range(16)]
    ordered = torch.tensor(sorted(values), dtype=torch.float64)
    assert ordered.numel() == 16
    mids = ((ordered[:-1] + ordered[1:]) / 2).float()
    qmap = ordered.float()
    assert bool((qmap[1:] > qmap[:-1]).all()) and bool((mids[1:] > mids[:-1]).all())
    return qmap, mids


@cache
def int4_kernel_mids() -> torch.Tensor:
    """m's midpoints in the kernel's form (csrc/adamw.c `quantize4_m`): the float32 patterns
    (int32) of the 8 positive ones. Checked here: the 7 negative ones are the negations of the
    7 lowest positive ones, and v's values are (k + 1) / 16 (the kernel computes its codes
    and values from that)."""
    mids_m, mids_v = int4_map(True)[1], int4_map(False)[1]
    assert torch.equal(-mids_m[:7].flip(0), mids_m[7:14]) and bool(mids_m[7] > 0 > mids_m[6])
    assert torch.equal(int4_map(False)[0], (torch.arange(16, dtype=torch.float32) + 1) / 16)
    assert torch.equal(mids_v, (torch.arange(15, dtype=torch.float32) + 1.5) / 16)
    return mids_m[7:].contiguous().view(torch.int32)


def int4_zero_code(*, signed: bool) -> int:
    """The code fresh states hold: 0.0 for m; v's smallest value (x an absmax of 0 is 0)."""
    return int(torch.searchsorted(int4_map(signed)[1], torch.tensor(0.0)).item())


def allocate_int4_states(numel: int) -> dict[str, torch.Tensor]:
    """Zero m and v of a block in the int4 layout, as ParamBlock keyword arguments."""
    from megatrain.store.memory import host_zeros

    nbytes, nblocks = INT4_HALF * num_int4_blocks(numel), num_int4_blocks(numel)
    codes = {
        key: host_zeros(nbytes, torch.uint8).fill_(code | code << 4)
        for key, code in (
            ("exp_avg", int4_zero_code(signed=True)),
            ("exp_avg_sq", int4_zero_code(signed=False)),
        )
    }
    return {
        **codes,
        "exp_avg_scale": host_zeros(nblocks, torch.float32),
        "exp_avg_sq_scale": host_zeros(nblocks, torch.float32),
    }


def quantize_int4(x: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes, fp32 absmax per INT4_BLOCK) of a flat fp32 tensor: nearest value."""
    pad = num_int4_blocks(x.numel()) * INT4_BLOCK - x.numel()
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, INT4_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalized = blocks / divisor[:, None]  # the padding: 0, the code of 0 / the smallest v
    codes = torch.searchsorted(int4_map(signed)[1].to(x.device), normalized).to(torch.uint8)
    return (codes[:, :INT4_HALF] | codes[:, INT4_HALF:] << 4).reshape(-1), absmax


def int4_codes(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The codes (0..15, int64) of the first `numel` values of packed blocks."""
    halves = torch.stack([packed & 15, packed >> 4]).view(2, -1, INT4_HALF)
    return halves.transpose(0, 1).reshape(-1)[:numel].long()


def dequantize_int4(
    packed: torch.Tensor, absmax: torch.Tensor, numel: int, *, signed: bool
) -> torch.Tensor:
    """fp32 values of the first `numel` codes: map value times the block's absmax (one
    rounding)."""
    qmap = int4_map(signed)[0].to(packed.device)
    scale = absmax.repeat_interleave(INT4_BLOCK)[:numel]
    return qmap[int4_codes(packed, numel)] * scale
