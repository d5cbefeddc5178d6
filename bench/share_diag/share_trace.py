"""MT_SHARE_DIAG_TRACE=1 (with MT_SHARE_DIAG_POSTMORTEM=1): where a step's NaN first appears.

Each forward records, on the device and without a sync point, the largest magnitude and the
non-finite count of the embedding's output (layer 0's input) and of every layer's output per
micro-batch, and copies each streamed layer's slot, once the compute stream has waited for its
weights, into a snapshot of its own (the weights that layer's forward computed with). The
post-mortem (sitecustomize.py) prints the step's trace in order and compares each snapshot with
the layer's host source: the first non-finite output with weights equal to the host's says the
layer's compute (or its input) went wrong, not its weights. Costs a copy of every streamed
layer's weights in GPU memory: for GPT-OSS-20B cut to a few layers.
"""

from __future__ import annotations

from typing import Any

TRACE: list[tuple[str, Any]] = []  # (label, device tensor [max |x|, non-finite]) this step
SNAPSHOTS: dict[int, Any] = {}  # layer -> its slot's weights as its forward read them


def _stats(x: Any, torch: Any) -> Any:
    flat = x.detach().reshape(-1).float()
    return torch.stack([flat.nan_to_num(0.0, 0.0, 0.0).abs().amax(), (~flat.isfinite()).sum()])


def patch_forward(module: Any) -> None:
    import torch

    forward, run_layer = module.ForwardPass._forward, module.ForwardPass._run_layer

    def traced_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        TRACE.clear()
        return forward(self, *args, **kwargs)

    def traced_run_layer(self: Any, i: int, mod: Any, mb: Any, x: Any, record: bool) -> Any:
        if i == 0 and record:
            TRACE.append(("embed out", _stats(x, torch)))
        out = run_layer(self, i, mod, mb, x, record)
        if record:
            TRACE.append((f"layer.{i} out", _stats(out, torch)))
        return out

    module.ForwardPass._forward = traced_forward
    module.ForwardPass._run_layer = traced_run_layer
    print("[diag] trace armed: layer outputs and slot snapshots", flush=True)


def patch_slots(module: Any) -> None:
    acquire = module.LayerSlots.acquire

    def snapped(self: Any, layer: int) -> Any:
        out = acquire(self, layer)  # the compute stream now waits for the slot's weights
        if layer >= self.resident:
            src = self.buffers[self.slot(layer)][: self.blocks[layer].numel]
            snap = SNAPSHOTS.get(layer)
            if snap is None or snap.numel() != src.numel():
                snap = SNAPSHOTS[layer] = src.clone()
            else:
                snap.copy_(src)
        return out

    module.LayerSlots.acquire = snapped


def report(engine: Any, differ: Any, torch: Any) -> None:
    """The step's trace in order, then each snapshot against its host source."""
    for label, stats in TRACE:
        top, bad = (float(v) for v in stats.tolist())
        flag = "  <-- NON-FINITE" if bad else ""
        print(f"[diag]   trace {label}: max {top:.4g}, {int(bad)} non-finite{flag}", flush=True)
    blocks = engine.slots.blocks
    for layer, snap in sorted(SNAPSHOTS.items()):
        n, bad = differ(snap, blocks[layer].source, torch)
        flag = "  <-- DIFFERS" if n else ""
        print(f"[diag]   snapshot layer.{layer} vs host: {n} differ, {bad} non-finite{flag}")
