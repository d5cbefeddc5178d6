"""Compact linear layers for the resident rollout: int8 or fp8 weights, per-output-channel scales.

When the compute-dtype copy of a large model does not fit on the GPU beside the engine, the
rollout (recipes/grpo/rollout.py) keeps the decoder layers' `nn.Linear` weights in one byte per
parameter and a float32 scale per output channel (row of the [out, in] weight):

- int8, symmetric: s = max|w_row| / 127, q = round(w / s) in [-127, 127]; each element is off
  by at most s / 2 (round to nearest);
- fp8 (float8_e4m3fn, 3 mantissa bits): s = max|w_row| / 448 (its largest finite value),
  q = fp8(w / s); a normal value (|w / s| >= 2^-6) is off by at most half an ulp, 2^-4 of
  itself, a subnormal one by at most s x 2^-10 (half their spacing 2^-9).

The forward computes x @ (q x s)^T (+ bias). fp8 on CUDA devices of compute capability >= 8.9
(Hopper, Ada) runs torch's scaled matmul (`torch._scaled_mm`: fp8 x fp8 with a float32 scale per
row of x, the activations quantized per token the same way, and one per weight row), reading one
byte per weight parameter. Elsewhere, and for int8, the weight is dequantized per call into the
compute dtype, DEQUANT_CHUNK_BYTES of it at a time, and multiplied as usual (the CPU tests run
this; the matmul reads the chunk back, so int8 decoding reads 1 + 2c bytes per parameter
against c for the compute dtype: it saves memory, not time).

What stays in the compute dtype: the embedding, the norms, the head (lm_head) and anything that
is not an `nn.Linear` inside a decoder layer, e.g. mixture-of-experts weights stored as 3-D
parameters (this first version keeps them as they are). The head's logits are what the sampler
and the log-probs read, so they keep the compute dtype's precision; embedding, norms and head
are a few percent of a large model's bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

COMPACT_FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # rollout_weights -> dtype
QUANT_MAX = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude of each format
SCALE_DTYPE = torch.float32  # one per output channel
DEQUANT_CHUNK_BYTES = 64 << 20  # the compute-dtype transient of one dequantized chunk
SCALED_MM_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada and Hopper onwards
SCALED_MM_MULTIPLE = 16  # torch._scaled_mm: both matrix dimensions of the weight multiples of this
# aten kernels one QuantLinear call launches beyond nn.Linear's (bf16 compute), as `forward`
# reads: dequantized, q.float(), the scale's multiply, the cast; fp8 tensor cores, the
# activations' abs, amax, float, clamp, divide, then float, divide, clamp, cast to fp8
EXTRA_OPS = {"dequantized": 3, "scaled_mm": 9}


def quantize(w_OI: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [O, I] in fmt's dtype, scale [O] float32) of a weight, per output channel (row).

    A row of zeros gets scale 1 (q = 0 represents it exactly). Computed in float32 on the
    weight's device."""
    top = QUANT_MAX[fmt]
    w = w_OI.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    x = (w / scale[:, None]).clamp_(-top, top)
    if fmt == "int8":
        x = x.round_()
    return x.to(COMPACT_FORMATS[fmt]), scale.to(SCALE_DTYPE)


def dequantize(q_OI: torch.Tensor, scale_O: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q x scale in `dtype` (the product in float32, rounded once to `dtype`)."""
    return (q_OI.float() * scale_O.float()[:, None]).to(dtype)


def scaled_mm_capable(device: torch.device) -> bool:
    """Whether fp8 weights multiply through torch._scaled_mm on `device`."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= SCALED_MM_CAPABILITY


class QuantLinear(nn.Module):
    """An `nn.Linear` whose weight is kept compact (module docstring); inference only."""

    qweight: torch.Tensor  # [out, in], int8 or float8_e4m3fn
    scale: torch.Tensor  # [out], float32

    def __init__(self, q_OI: torch.Tensor, scale_O: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.fmt = next(k for k, d in COMPACT_FORMATS.items() if d == q_OI.dtype)
        self.out_features, self.in_features = q_OI.shape
        self.register_buffer("qweight", q_OI)
        self.register_buffer("scale", scale_O)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.scaled_mm = (
            self.fmt == "fp8"
            and scaled_mm_capable(q_OI.device)
            and q_OI.shape[0] % SCALED_MM_MULTIPLE == 0
            and q_OI.shape[1] % SCALED_MM_MULTIPLE == 0
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm and x.dtype == torch.bfloat16:
            return self._scaled_forward(x)
        rows = max(1, DEQUANT_CHUNK_BYTES // (x.element_size() * self.in_features))
        parts = [
            F.linear(x, dequantize(q, s, x.dtype))
            for q, s in zip(self.qweight.split(rows), self.scale.split(rows), strict=True)
        ]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out if self.bias is None else out + self.bias

    def _scaled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp8 x fp8 on the tensor cores: x quantized per token (row), float32 accumulation."""
        top = QUANT_MAX["fp8"]
        x_MI = x.reshape(-1, self.in_features)
        amax = x_MI.abs().amax(dim=1, keepdim=True).float()
        x_scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / top
        xq = (x_MI.float() / x_scale).clamp_(-top, top).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            xq,
            self.qweight.t(),  # [I, O] column-major, as the second operand must be
            scale_a=x_scale,
            scale_b=self.scale[None, :],
            bias=self.bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*x.shape[:-1], self.out_features)


def compact_linears(layers: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers a compact rollout quantizes, by dotted name under `layers` (the
    decoder layers): every `nn.Linear` inside them (module docstring: what stays)."""
    return {n: m for n, m in layers.named_modules() if isinstance(m, nn.Linear)}


def quantized_params(layers: nn.Module) -> int:
    """Weight parameters a compact rollout keeps in one byte each (meta parameters count)."""
    return sum(m.weight.numel() for m in compact_linears(layers).values())


def compact_weight_bytes(layers: nn.Module, compute_bytes: int) -> int:
    """GPU bytes of the decoder layers kept compact: one byte per quantized weight parameter
    and a float32 scale per output channel; every other parameter in the compute dtype
    (`compute_bytes` each). Counts shapes only (meta parameters do)."""
    linear = compact_linears(layers).values()
    quantized = {id(m.weight) for m in linear}
    total = sum(m.weight.numel() + m.out_features * SCALE_DTYPE.itemsize for m in linear)
    others = (p for p in layers.parameters() if id(p) not in quantized)
    return total + sum(p.numel() * compute_bytes for p in others)
