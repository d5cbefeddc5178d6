"""Diagnostic hook for the GPU update share's NaN (docs/optimizer_states.md, "The share's NaN";
docs/performance.md runs 66-73). Not a product switch: nothing in src/ reads it.

With this folder first on PYTHONPATH and MT_SHARE_DIAG=<mode>, every Python process of the run
(bench/cli_train.py starts `python -m megatrain train` with the environment as it is) patches
engine/gpu_share.py as it is imported: REFERENCE_ONLY off (the fused Triton kernel updates the
share's blocks, as the product does since run 72; MT_SHARE_DIAG_KERNEL=reference takes the
torch reference; the staging sets are the config's `optimizer.gpu_update_sets`, 2 as before
run 72: with 1 the modes below run beside the product's one-set order, which `serial` is),
MT_SHARE_DIAG_TIER=reference the torch reference for the GPU tier's updates too; each thread's
first fused launches print the stream torch has current and the one Triton launches on. By
mode, one change around each share update (`GpuShare.update`, on the share's worker thread);
the results are with two sets:

  none         gpu_share.py as it is (with MT_SHARE_DIAG_POSTMORTEM=1)
  fused        nothing more (runs 66, 68: NaN)
  hostwait     the worker waits on the host for the up stream after the kernel (run 68: NaN)
  d2hwait      the up stream waits for the gradient copy stream first (run 68: NaN)
  h2dwait      the up stream waits for the weight copy stream first (run 71: result lost)
  computewait  the up stream waits for the compute (default) stream first (run 71: NaN)
  serial       the up stream waits for the previous update's copies back first (one block's
               copies back never beside the next one's copies in: what `presync` and `verify`,
               the two modes without a NaN, also ensure, and `hostwait`/`d2hwait` do not;
               run 71: 10 steps clean where `fused` gave a NaN at step 3; the product's order
               since run 72)
  presync      the device synchronized first (run 67, on the main thread: no NaN)
  verify       each update checked against the C kernel: the block's host master and states
               and its held gradient copied to the host first (on a stream of its own), the
               update's results, once back on the host, compared with the C kernel's update of
               that copy; one line per update that differs or is not finite (run 70, fused:
               none in 6 steps, and no NaN)
  mainthread   the share's worker unthreaded: each update issued on the main thread when it is
               submitted (its copies and kernel still on the share's two streams)
  hostalloc    the share's host master, states and shadow moved into cudaHostAlloc memory
               (torch's pinned allocator) instead of the store's mappings registered in place

Run 76 found the cause (docs/optimizer_states.md, "The share's NaN"): with
MT_SHARE_DIAG_TRACE=1 (share_trace.py) the post-mortem showed the weights every layer read
equal to their host sources and the embedding's output already non-finite in six of eight
micro-batches; under CUDA_LAUNCH_BLOCKING=1 the run was clean. The embedding rows' copy into
memory the compute stream had freed with writes still queued is ordered after them since
(engine/transfers.py `h2d_new`); with it `fused` on two sets ran 6 steps clean, twice.

MT_SHARE_DIAG_POSTMORTEM=1 (with any mode, or alone with MT_SHARE_DIAG=none: the product as it
is): once a step's loss is known (after its head's backward, before any of its updates is
submitted) it is read on the host; if it is not finite, every pending update is waited for and
every block's tensors (host or device: master, shadow, states' scales, held gradients) are
scanned; each line names a block and tensor with its largest magnitude and its non-finite
count; then the weights the step's forward used on the device (the layers its slots still
hold, the head's buffer) are compared with their host sources, and the run stops. Run 74: at a
NaN every host tensor was finite (only the head's new gradient, computed from the NaN loss,
was not), so the fault corrupted the step's compute or its device copies, not the weights and
states the updates wrote. MT_SHARE_DIAG_TRACE=1 adds share_trace.py's trace of the step (each
layer's output per micro-batch, each slot's weights as its forward read them) to it.

    PYTHONPATH=bench/share_diag:src:bench MT_SHARE_DIAG=verify python bench/cli_train.py \\
        --name diag_verify --preset gpt-oss-20b --layers 4 --rows 32 --micro 4 --steps 8 -- \\
        --optimizer.state_dtype int8 --memory.gpu_state_blocks 0 \\
        --optimizer.gpu_update_blocks 3 --optimizer.gpu_update_sets 2
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from import_patches import install

MODE = os.environ.get("MT_SHARE_DIAG")
POSTMORTEM = os.environ.get("MT_SHARE_DIAG_POSTMORTEM") == "1"
TRACE = POSTMORTEM and os.environ.get("MT_SHARE_DIAG_TRACE") == "1"  # share_trace.py
MODES = (
    "none",
    "fused",
    "hostwait",
    "d2hwait",
    "h2dwait",
    "computewait",
    "serial",
    "presync",
    "verify",
    "mainthread",
    "hostalloc",
)


def _before(share: Any, torch: Any) -> None:
    up, transfers = share._up, share.transfers
    if MODE == "presync":
        torch.cuda.synchronize()
    elif MODE == "d2hwait":
        up.wait_stream(transfers.d2h_stream)
    elif MODE == "h2dwait":
        up.wait_stream(transfers.h2d_stream)
    elif MODE == "computewait":
        up.wait_stream(torch.cuda.default_stream(transfers.device))
    elif MODE == "serial":  # the previous update's copies back, whichever staging set it took
        last = share._free[(share._turn - 1) % len(share._free)]
        if last is not None:
            up.wait_event(last)


def _snapshot(share: Any, block: Any, torch: Any) -> Any:
    """A host copy of the block as the C kernel would update it: master, states, and the held
    gradient in the shadow (the landing of an fp32 master's bf16 gradient)."""
    states = {k: t.clone() for k, t in block.state_tensors().items()}
    held = share._held[block.name][0]
    if not share.transfers.is_cuda:
        grad = held.clone()
    else:
        if not hasattr(share, "_diag_stream"):
            share._diag_stream = torch.cuda.Stream(share.transfers.device)
        with torch.cuda.stream(share._diag_stream):
            grad = held.to("cpu")  # waits for this stream only; the gradient is written
    assert block.shadow is not None and grad.dtype == block.shadow.dtype, "shadow hold only"
    return dataclasses.replace(block, master=block.master.clone(), shadow=grad, **states)


def _compare(share: Any, block: Any, ref: Any, lr: float, grad_scale: float, torch: Any) -> None:
    if block.name in share._back:
        share._back[block.name].synchronize()  # the share's results are on the host
    share.optimizer.update(ref, lr=lr, grad_scale=grad_scale)
    got = {"master": block.master, "shadow": block.shadow, **block.state_tensors()}
    want = {"master": ref.master, "shadow": ref.shadow, **ref.state_tensors()}
    differ = {k: int((got[k] != want[k]).sum()) for k in want if not torch.equal(got[k], want[k])}
    bad = {
        k: int((~torch.isfinite(t)).sum())
        for k, t in got.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    }
    if differ or bad:
        print(f"[diag] step {block.step} {block.name}: differ {differ} non-finite {bad}")


def _patch_init(module: Any, torch: Any) -> None:
    """`mainthread`: the share's worker runs unthreaded (each update issued on the main thread
    at submit, its copies and kernel still on the share's streams); `hostalloc`: the share's
    host tensors moved into memory from CUDA's pinned allocator (cudaHostAlloc) instead of the
    store's mappings registered in place (the old ones are dropped: host RAM is not doubled)."""
    init = module.GpuShare.__init__

    def diag_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if MODE == "mainthread":
            kwargs["threaded"] = False
        init(self, *args, **kwargs)
        if MODE == "hostalloc" and self.transfers.is_cuda:
            for block in self.blocks:
                for name, tensor in module._host_tensors(block).items():
                    moved = torch.empty_like(tensor, pin_memory=True).copy_(tensor)
                    setattr(block, name, moved)

    module.GpuShare.__init__ = diag_init


def _patch(module: Any) -> None:
    import torch

    kernel = os.environ.get("MT_SHARE_DIAG_KERNEL", "fused")  # or "reference"
    module.REFERENCE_ONLY = kernel == "reference"
    update = module.GpuShare.update

    def diag_update(self: Any, block: Any, *, lr: float, grad_scale: float = 1.0) -> None:
        ref = _snapshot(self, block, torch) if MODE == "verify" else None
        if self._up is not None:  # CUDA (on the CPU the update is done on return)
            _before(self, torch)
        update(self, block, lr=lr, grad_scale=grad_scale)
        if MODE == "hostwait" and self._up is not None:
            self._up.synchronize()
        if ref is not None:
            _compare(self, block, ref, lr, grad_scale, torch)
        return None

    module.GpuShare.update = diag_update
    _patch_init(module, torch)
    _probe_streams(torch)
    print(
        f"[diag] GPU update share: {kernel} update, mode {MODE}",
        flush=True,
    )


def _probe_streams(torch: Any) -> None:
    """Each thread's first fused launches: the stream torch has current and the one Triton's
    driver launches on (they must be the same); MT_SHARE_DIAG_TIER=reference takes the fused
    kernel away from every device update (the GPU tier's too)."""
    import threading

    from megatrain.optim import triton_adamw

    if os.environ.get("MT_SHARE_DIAG_TIER") == "reference":
        triton_adamw.supports = lambda block: False
        print("[diag] every device update through the torch reference", flush=True)
    fused, seen = triton_adamw.fused_update, {}

    def probed(block: Any, s: Any) -> None:
        name = threading.current_thread().name
        seen[name] = seen.get(name, 0) + 1
        if seen[name] <= 2 and block.master.is_cuda:
            from triton.runtime import driver

            index = block.master.device.index
            print(
                f"[diag] fused {block.name} on {name}: torch stream "
                f"{torch.cuda.current_stream(index).cuda_stream:#x}, triton stream "
                f"{driver.active.get_current_stream(index):#x}",
                flush=True,
            )
        fused(block, s)

    triton_adamw.fused_update = probed


def _scan(tensor: Any, torch: Any) -> tuple[float, int]:
    """(largest magnitude, non-finite count) of a float tensor, in 64M-value chunks."""
    flat, top, bad = tensor.reshape(-1), 0.0, 0
    for at in range(0, flat.numel(), 1 << 26):
        part = flat[at : at + (1 << 26)].float()
        finite = torch.isfinite(part)
        bad += int((~finite).sum())
        if bool(finite.any()):
            top = max(top, float(part[finite].abs().max()))
    return top, bad


def _postmortem(engine: Any, loss: float, torch: Any) -> None:
    """Every block's tensors after a non-finite loss (the step's updates not yet submitted)."""
    engine.wait_updates()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"[diag] postmortem: loss {loss}; tensors (block, name, where, max |x|, non-finite)")
    share = getattr(engine, "share", None)
    held = getattr(share, "_held", {}) if share is not None else {}
    for block in engine.store.blocks:
        tensors = {"master": block.master, "shadow": block.shadow, **block.state_tensors()}
        tensors.update({f"held{i}": t for i, t in enumerate(held.get(block.name, []))})
        for name, tensor in tensors.items():
            if tensor is None or not tensor.is_floating_point():
                continue
            top, bad = _scan(tensor, torch)
            flag = "  <-- NON-FINITE" if bad else ""
            where = tensor.device.type
            print(f"[diag]   {block.name} {name} {where} {top:.4g} {bad}{flag}", flush=True)
    _compare_device(engine, torch)
    if TRACE:
        import share_trace

        share_trace.report(engine, _differ, torch)
    raise FloatingPointError(f"[diag] postmortem done: loss {loss}")


def _differ(device: Any, host: Any, torch: Any) -> tuple[int, int]:
    """(values that differ, non-finite values) of a device copy against its host source."""
    device, host, differ, bad = device.reshape(-1), host.reshape(-1), 0, 0
    for at in range(0, host.numel(), 1 << 26):
        mine = device[at : at + (1 << 26)]
        differ += int((mine != host[at : at + (1 << 26)].to(mine.device)).sum())
        bad += int((~torch.isfinite(mine.float())).sum())
    return differ, bad


def _compare_device(engine: Any, torch: Any) -> None:
    """The weights this step's forward computed with (the streamed layers its slots still hold,
    the head's buffer) against their host sources, which the scan above found finite or not:
    a device copy that differs was corrupted on the device or copied before its update was."""
    slots = engine.slots
    pairs = [
        (f"slot {s}: layer.{layer}", slots.buffers[s], slots.blocks[layer])
        for s, layer in enumerate(slots.holds)
        if layer is not None and layer >= slots.resident
    ]
    if engine.store.head not in engine.tier:
        pairs.append(("head buffer", engine.head_buf, engine.store.head))
    for where, buffer, block in pairs:
        differ, bad = _differ(buffer.reshape(-1)[: block.numel], block.source, torch)
        flag = "  <-- DIFFERS" if differ else ""
        print(f"[diag]   {where} vs host {block.name}: {differ} differ, {bad} non-finite{flag}")


def _patch_engine(module: Any) -> None:
    import math

    import torch

    loss_pass = module.StreamingEngine._loss

    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = loss_pass(self, *args, **kwargs)
        value = float(out[0])  # sync point (host): the diagnostic's only one
        if not math.isfinite(value):
            _postmortem(self, value, torch)
        return out

    module.StreamingEngine._loss = checked
    print("[diag] postmortem armed: a non-finite loss scans every block", flush=True)


def _trace_forward(module: Any) -> None:
    import share_trace

    share_trace.patch_forward(module)


def _trace_slots(module: Any) -> None:
    import share_trace

    share_trace.patch_slots(module)


PATCHES = {
    **({"megatrain.engine.gpu_share": _patch} if MODE not in (None, "none") else {}),
    **({"megatrain.engine.engine": _patch_engine} if POSTMORTEM else {}),
    **({"megatrain.engine.forward": _trace_forward} if TRACE else {}),
    **({"megatrain.engine.slots": _trace_slots} if TRACE else {}),
}
"""The modules patched as they are imported, by what the environment asks for."""


if MODE or POSTMORTEM:
    if MODE is not None and MODE not in MODES:
        raise SystemExit(f"MT_SHARE_DIAG must be one of {', '.join(MODES)}, got {MODE!r}")
    install(PATCHES)
