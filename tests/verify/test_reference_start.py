"""verify judges each step on its own arithmetic: before every step after the first, each
reference (fp32 PyTorch, the float64 target) takes the engine's weights and AdamW states, so a
within-tolerance difference of one step is not amplified by the next steps' ill-conditioned
gradients (a linear-attention decay's, say) into a failure that only says which CPU ran it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.verify import run_verify, verify_config, within
from megatrain.verify.reference import EngineState, Reference


def test_references_start_each_step_from_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[tuple[str, int]] = []
    original = Reference.start_from

    def start_from(self: Any, state: EngineState) -> None:
        original(self, state)
        steps = set()
        for name, master in self.master.items():
            weight, exp_avg, exp_avg_sq, step = state[name]
            # exact copies: fp32 into fp32, and fp32 into float64 without rounding
            assert torch.equal(master.detach(), weight.to(master.dtype)), name
            opt_state = self.opt.state[master]
            assert torch.equal(opt_state["exp_avg"], exp_avg.to(master.dtype)), name
            assert torch.equal(opt_state["exp_avg_sq"], exp_avg_sq.to(master.dtype)), name
            assert int(opt_state["step"]) == step
            steps.add(step)
        starts.append((str(next(iter(self.master.values())).dtype), steps.pop()))
        assert not steps  # every block has taken the same number of steps

    monkeypatch.setattr(Reference, "start_from", start_from)
    reports = run_verify(verify_config(model_type="qwen3_5_text", tiny=True, packed=True), steps=3)
    assert within(reports)
    # after steps 1, 2 and 3: the fp32 reference and the float64 target, at the engine's step
    assert sorted(starts) == sorted(
        (dtype, step) for step in (1, 2, 3) for dtype in ("torch.float32", "torch.float64")
    )
