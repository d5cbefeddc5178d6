"""Dropout in the engine: the backward recompute applies exactly the forward's masks, and the
gradient equals plain PyTorch's with the same masks (Seed-OSS: attention and residual dropout).

`megatrain verify` turns dropout off on both sides (two implementations draw their random numbers
in a different order, so their masks differ); these tests prove training with dropout instead.
The mask test runs on CUDA too (its cuda cases are marked `gpu`: skipped without a device).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.engine.engine import StreamingEngine
from megatrain.engine.microbatch import shifted_targets
from megatrain.engine.plan import EnginePlan
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.host import HostStore
from megatrain.verify import make_batches, verify_config

DROPOUT = {"attention_dropout": 0.25, "residual_dropout": 0.25}


def _engine(device: str, attn: str) -> tuple[StreamingEngine, HostStore]:
    model = load_causal_lm(
        None, model_type="seed_oss", tiny=True, attn_implementation=attn, config_overrides=DROPOUT
    )
    structure = discover(model)
    store = HostStore(structure, compute_dtype=torch.float32, pin_memory=device == "cuda")
    plan = EnginePlan(num_slots=2, clip_norm=1.0, loss_chunk_tokens=64)
    engine = StreamingEngine(structure, store, CpuAdamW(AdamWHyper()), plan, device=device)
    return engine, store


def _batches(vocab: int = 256) -> list[Batch]:
    return make_batches(verify_config(model_type="llama", tiny=True), 1, vocab, 0, 2, 2)[0]


def _record_layer_outputs(engine: StreamingEngine) -> dict[str, list[torch.Tensor]]:
    """Each layer call's output: forward calls (record=True), then the backward's recomputes."""
    seen: dict[str, list[torch.Tensor]] = {"forward": [], "recompute": []}
    run = engine._run_layer

    def recording(i: int, module: Any, mb: Any, x: torch.Tensor, record: bool) -> torch.Tensor:
        out = run(i, module, mb, x, record)
        seen["forward" if record else "recompute"].append(out.detach().clone())
        return out

    engine._run_layer = recording  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_recompute_repeats_the_forward_dropout_masks(device: str, attn: str) -> None:
    """Layer outputs recomputed in backward equal the forward's exactly: same inputs, same
    weights, same kernels; only a different dropout mask could change them (by ~100%)."""
    engine, store = _engine(device, attn)
    seen = _record_layer_outputs(engine)
    batches = _batches()
    try:
        engine.train_step(batches, lr=1e-3)
    finally:
        engine.close()
    layers, micro = len(store.layers), len(batches)
    forward, recompute = seen["forward"], seen["recompute"]
    assert len(forward) == len(recompute) == layers * micro
    for n, again in enumerate(recompute):  # backward: last layer first, micro-batches in order
        layer, mb = layers - 1 - n // micro, n % micro
        first = forward[layer * micro + mb]
        assert torch.equal(first, again), f"layer {layer}, micro-batch {mb} differs"


class _MaskTape:
    """F.dropout drawing its mask from the same generator as torch's, recording every mask."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []
        self.replay: Iterator[torch.Tensor] | None = None

    def dropout(
        self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        if self.replay is not None:
            mask = next(self.replay)
        else:
            mask = torch.empty_like(x).bernoulli_(1 - p)
            self.masks.append(mask)
        return x * (mask / (1 - p))


def test_gradient_equals_pytorch_with_the_same_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's gradient with dropout on equals the HF model's (eager attention, so every
    mask goes through F.dropout) replaying the masks the engine's forward drew."""
    tape = _MaskTape()
    monkeypatch.setattr(F, "dropout", tape.dropout)
    engine, store = _engine("cpu", "eager")
    landed: dict[str, torch.Tensor] = {}

    def snapshot(block: Any) -> None:
        for e in block.entries:
            landed[e.full_name] = block.view(block.grad_landing, e).clone()

    engine.worker.on_landed = snapshot
    batches = _batches()
    layers, micro = len(store.layers), len(batches)
    try:
        engine.train_step(batches, lr=1e-3)
    finally:
        engine.close()
    forward = tape.masks[: len(tape.masks) // 2]  # then the recompute's, identical
    per_call = len(forward) // (layers * micro)
    assert per_call == 3 and len(tape.masks) == 2 * len(forward)  # attention, 2 residuals
    # The engine ran layer-major (layer, micro-batch); PyTorch runs micro-batch-major.
    order = [
        forward[(layer * micro + mb) * per_call + c]
        for mb in range(micro)
        for layer in range(layers)
        for c in range(per_call)
    ]
    tape.replay = iter(order)
    grads = _reference_grads(batches, _fresh_model())
    for name, ref in grads.items():
        rel = float((landed[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        # fp32 against fp32 in another summation order: verify measures <= 1.1e-6 on this
        # model without dropout; a single different mask moves a gradient by O(1).
        assert rel < 1e-4, f"{name}: relative error {rel:.2e}"


def _fresh_model() -> torch.nn.Module:
    return load_causal_lm(
        None,
        model_type="seed_oss",
        tiny=True,
        attn_implementation="eager",
        config_overrides=DROPOUT,
    )


def _reference_grads(batches: list[Batch], model: Any) -> dict[str, torch.Tensor]:
    denom = sum(b.num_target_tokens for b in batches)
    for b in batches:
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
        loss = F.cross_entropy(
            out.logits.flatten(0, 1).float(),
            shifted_targets(b.labels).flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        (loss / denom).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
