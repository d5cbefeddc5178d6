"""The GPU update share's fused Triton AdamW (optim/triton_adamw.py) against the host's C kernel:
bit for bit, for every format it takes (fp32 master; fp32, bf16 and int8 states; fp32 and bf16
gradients; with and without the bf16 shadow), across a decay boundary inside a quantization
block and a partial last block.

Bit for bit, not a tolerance: both sides perform the same correctly rounded float32 operations
in the same order (no fused multiply-adds: the kernel is compiled without fp fusion, and the C
code with -ffp-contract=off), so any difference is a bug. On the CPU the kernel runs under
Triton's interpreter (TRITON_INTERPRET=1, numpy's IEEE float32, in a subprocess: the variable
must be set before the kernel is defined); on CUDA, compiled (marked gpu).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from state_blocks import host_block as _block
from state_blocks import spread_grad as _grad

pytest.importorskip("triton")
needs_kernel = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler")

SIZES = [(1, 1), (2047, 0), (3 * 2048 + 5, 2048 + 100)]
SCALES = [1.0, 0.37, 1.0, 0.05]  # clipping coefficients of successive steps


def _on(block: ParamBlock, device: str, bf16_grads: bool) -> ParamBlock:
    """The block as the share stages it on `device`: its own copies of master and states, a
    bf16 shadow, and the gradient in a buffer of its own (the share's held gradient)."""
    moved = {k: t.to(device, copy=True) for k, t in block.state_tensors().items()}
    grad_dtype = torch.bfloat16 if bf16_grads else torch.float32
    return dataclasses.replace(
        block,
        master=block.master.to(device, copy=True),
        shadow=torch.zeros(block.numel, dtype=torch.bfloat16, device=device),
        grad=torch.zeros(block.numel, dtype=grad_dtype, device=device),
        **moved,
    )


def check_parity(device: str) -> list[str]:
    """Every format and size, SCALES' steps each; the cases that differ from the C kernel."""
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    c_opt = CpuAdamW(hyper, impl="c", num_threads=2)
    failed = []
    for state_dtype in ("fp32", "bf16", "int8"):
        for bf16_grads in (False, True):
            for n, decay_numel in SIZES:
                host = _block(n, decay_numel, state_dtype, bf16_grads=True)  # gradient in shadow
                staged = _on(host, device, bf16_grads)
                gen = torch.Generator().manual_seed(1)
                for step, scale in enumerate(SCALES):
                    grad = _grad(n, step, gen)
                    grad = grad.bfloat16().float() if bf16_grads else grad
                    host.grad = grad.clone() if not bf16_grads else None
                    host.shadow.copy_(grad)  # type: ignore[union-attr]
                    staged.grad.copy_(grad)  # type: ignore[union-attr]
                    c_opt.update(host, lr=3e-3, grad_scale=scale)
                    c_opt.update_device(staged, lr=3e-3, grad_scale=scale, chunk=2048)
                    pairs = [(host.master, staged.master), (host.shadow, staged.shadow)]
                    tensors = staged.state_tensors()
                    pairs += [(t, tensors[k]) for k, t in host.state_tensors().items()]
                    if not all(torch.equal(a, b.cpu()) for a, b in pairs):
                        failed.append(f"{state_dtype} bf16_grads={bf16_grads} n={n} step={step}")
                        break
    return failed


@needs_kernel
def test_fused_kernel_equals_the_c_kernel_in_the_interpreter() -> None:
    code = (
        f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, "
        f"{str(Path(__file__).parents[1])!r}]\n"
        "import test_triton_adamw as t\n"
        "from megatrain.optim import triton_adamw\n"
        "assert triton_adamw.interpreting()\n"
        "print('FAILED', t.check_parity('cpu'))\n"
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "FAILED []", out.stdout[-3000:]


@needs_kernel
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_kernel_equals_the_c_kernel_on_cuda() -> None:
    assert check_parity("cuda") == []


@needs_kernel
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("threaded", [False, True])
def test_fused_kernel_orders_with_its_streams_copies(threaded: bool) -> None:
    """As the GPU update share would run it (engine/gpu_share.py `update`, REFERENCE_ONLY):
    from a worker thread or not, master and int8 states copied up from pinned memory and the
    kernel on one stream, an event recorded after it, and the copies back on a second stream
    that waits for that event, with no host wait between them. The kernel must be launched on
    the first stream (Triton's notion of the current stream), after the copies in and before
    the event: a large block (64M values, 0.4 GB up) and three steps equal the C kernel's bit
    for bit. Run 66 (docs/performance.md) saw the share with this kernel give NaN losses at
    full width; this checks the ordering it depends on (passed in run 67, with the copies back
    on the same stream then)."""
    import threading

    from triton.runtime import driver

    n = 64 << 20
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    c_opt = CpuAdamW(hyper, impl="c")
    host = _block(n, n // 2, "int8", bf16_grads=True)
    pinned = {k: t.pin_memory() for k, t in {"master": host.master, **host.state_tensors()}.items()}
    staged = _on(host, "cuda", bf16_grads=True)
    side, back = torch.cuda.Stream(), torch.cuda.Stream()
    gen = torch.Generator().manual_seed(2)
    launched: list[int] = []

    def run() -> None:
        with torch.cuda.stream(side):
            for k, t in pinned.items():
                getattr(staged, k).copy_(t, non_blocking=True)
            launched.append(driver.active.get_current_stream(torch.cuda.current_device()))
            c_opt.update_device(staged, lr=3e-3, grad_scale=0.5, chunk=n)
            computed = torch.cuda.Event()
            computed.record(side)
        with torch.cuda.stream(back):
            back.wait_event(computed)
            for k, t in pinned.items():
                t.copy_(getattr(staged, k), non_blocking=True)

    for step in range(3):
        grad = _grad(n, step, gen).bfloat16()
        host.shadow.copy_(grad)  # type: ignore[union-attr]
        staged.grad.copy_(grad)  # type: ignore[union-attr]
        torch.cuda.synchronize()
        c_opt.update(host, lr=3e-3, grad_scale=0.5)
        if threaded:
            worker = threading.Thread(target=run)
            worker.start()
            worker.join()
        else:
            run()
        back.synchronize()
        assert launched[-1] == side.cuda_stream
        expected = {"master": host.master, **host.state_tensors()}
        assert all(torch.equal(expected[k], t) for k, t in pinned.items()), step
