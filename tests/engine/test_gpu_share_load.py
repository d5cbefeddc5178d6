"""The GPU update share's own machinery (engine/gpu_share.py `GpuShare`) under load, against
the host's C kernel bit for bit: three int8-state blocks, each step their gradients held on
the device (`hold`, beside compute-stream work), their updates submitted in forward order to
the share's worker thread, the compute stream kept busy while they run (the next forward),
then `wait` for each and the weights copied up from its host shadow as the forward would copy
them. Master, states, scales, shadow and the copied weights must equal the C kernel's update of
a host copy on the same held gradient, every step.

On the CPU (CI) the share runs its synchronous path with the torch reference. On CUDA (marked
gpu) large blocks (48M values) in each staging-set count the plan may choose (engine/plan.py
STAGING_SET_CHOICES), with the fused Triton kernel (the product, for these formats) and the
torch reference (REFERENCE_ONLY on): the machinery run 66 (docs/performance.md) saw give NaN
losses on GPT-OSS-20B, here without the model. With two staging sets both CUDA cases passed on
an H200 (runs 68 and 72), where the model's runs did not (run 71 found the order that
mattered: engine/gpu_share.py "Staging sets"); with one in run 73.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain.engine import gpu_share
from megatrain.engine.gpu_share import BlockFormats, GpuShare, packed_bytes
from megatrain.engine.plan import STAGING_SET_CHOICES
from megatrain.engine.transfers import Transfers
from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.memory import host_zeros
from megatrain.store.states import QUANT_BLOCK
from state_blocks import host_block, spread_grad

STEPS = 6
SCALES = [1.0, 0.37, 1.0, 0.05, 0.8, 1.0]  # clipping coefficients of successive steps
FORMATS = BlockFormats("fp32", "int8", "shadow")
needs_kernel = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler")
cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _host_copy(block: ParamBlock) -> ParamBlock:
    """A separate host block with the same values: the C kernel's side."""
    states = {k: t.clone() for k, t in block.state_tensors().items()}
    assert block.shadow is not None
    return dataclasses.replace(
        block, master=block.master.clone(), shadow=block.shadow.clone(), **states
    )


def _busy(load: torch.Tensor | None, rounds: int) -> None:
    """Compute-stream work beside the share (matmuls on the current stream)."""
    if load is None:
        return
    out = torch.empty_like(load)
    for _ in range(rounds):
        torch.mm(load, load, out=out)


def _tensors(block: ParamBlock) -> dict[str, torch.Tensor]:
    assert block.shadow is not None
    return {"master": block.master, "shadow": block.shadow, **block.state_tensors()}


@needs_kernel
@pytest.mark.parametrize("sets", STAGING_SET_CHOICES)
@pytest.mark.parametrize(
    ("device", "numel", "fused"),
    [
        ("cpu", 3 * QUANT_BLOCK + 5, False),
        pytest.param("cuda", 48 << 20, False, marks=cuda, id="cuda-reference"),
        pytest.param("cuda", 48 << 20, True, marks=cuda, id="cuda-fused"),
    ],
)
def test_share_under_load_equals_the_host_kernel(
    device: str, numel: int, fused: bool, sets: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_share, "REFERENCE_ONLY", not fused)
    dev = torch.device(device)
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    optimizer = CpuAdamW(hyper, impl="c", num_threads=4)
    blocks = [  # forward order; sizes differ (a partial last quantization block in each)
        dataclasses.replace(
            host_block(numel + i * (QUANT_BLOCK + 7), numel // (i + 2), "int8", bf16_grads=True),
            name=name,
        )
        for i, name in enumerate(("layer.5", "layer.6", "head"))
    ]
    for block in blocks:  # master and weights where the store keeps them (page-aligned)
        block.master = host_zeros(block.numel, torch.float32).copy_(block.master)
        block.shadow = host_zeros(block.numel, torch.bfloat16).copy_(block.master)
    refs = [_host_copy(b) for b in blocks]
    grads = torch.empty(
        sum(packed_bytes(FORMATS.gradient_parts(b.numel)) for b in blocks),
        dtype=torch.uint8,
        device=dev,
    )
    largest = max(packed_bytes(FORMATS.staging_parts(b.numel)) for b in blocks)
    staging = [torch.empty(largest, dtype=torch.uint8, device=dev) for _ in range(sets)]
    transfers = Transfers(dev)
    share = GpuShare(blocks, FORMATS, optimizer, transfers, grads=grads, staging=staging)
    load = torch.randn(4096, 4096, device=dev) if dev.type == "cuda" else None
    gen = torch.Generator().manual_seed(3)
    try:
        for step, coef in enumerate(SCALES[:STEPS]):
            accs = [spread_grad(b.numel, step, gen).to(dev) for b in blocks]
            landed = []
            for block, acc in zip(reversed(blocks), reversed(accs), strict=True):  # backward
                _busy(load, 4)
                landed.append(share.hold(block, acc)[1])
            if dev.type == "cuda":
                torch.cuda.current_stream().synchronize()  # as the engine reads the norm
            for order, (block, event) in enumerate(zip(blocks, reversed(landed), strict=True)):
                share.submit(block, event, order=order, lr=3e-3, grad_scale=coef)
            _busy(load, 20)  # the next forward, beside the updates
            for block, ref, acc in zip(blocks, refs, accs, strict=True):
                share.wait(block)
                weights = torch.empty(block.numel, dtype=torch.bfloat16, device=dev)
                transfers.h2d(weights, block.shadow).synchronize()  # type: ignore[arg-type]
                ref.shadow.copy_(acc.cpu())  # type: ignore[union-attr]  # the held bf16 gradient
                optimizer.update(ref, lr=3e-3, grad_scale=coef)
                got, want = _tensors(block), _tensors(ref)
                differ = [k for k in want if not torch.equal(got[k], want[k])]
                assert not differ, (step, block.name, differ)
                assert torch.equal(weights.cpu(), want["shadow"]), (step, block.name)
    finally:
        share.close()
