"""The chunked loss holds one chunk's gradients at a time (engine/head.py's invariant): the head
weight's gradient is as large as the weight, and the plan's loss phase counts one of them
(planning/activations.py `loss_chunk`). Before run 44 each chunk's gradients lived on until
the next chunk's had been made, one head-weight-sized tensor over the plan."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from megatrain.engine.head import ChunkedLoss
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover


def test_each_chunk_frees_its_gradients_before_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    structure = discover(load_causal_lm(None, model_type="llama", tiny=True))
    head = ChunkedLoss(structure, structure.final_norm, structure.lm_head, chunk_tokens=8)
    params = [p for m in (structure.final_norm, structure.lm_head) for p in m.parameters()]
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    hidden = torch.randn(2, 16, structure.causal_lm.config.hidden_size)
    targets = torch.randint(0, structure.causal_lm.config.vocab_size, (2, 16))

    made: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []
    grad = torch.autograd.grad

    def tracked(*args: Any, **kwargs: Any) -> Any:
        alive.append(sum(ref() is not None for ref in made))
        out = grad(*args, **kwargs)
        made.extend(weakref.ref(g) for g in out if g is not None)
        return out

    monkeypatch.setattr(torch.autograd, "grad", tracked)
    loss, _, grad_hidden = head.run(hidden, targets, float(targets.numel()), params, acc)
    assert len(alive) == 4 and alive == [0, 0, 0, 0]  # 32 targets in chunks of 8
    assert grad_hidden is not None and grad_hidden.shape == hidden.shape
    assert torch.isfinite(loss) and all(a.abs().sum() > 0 for a in acc)
