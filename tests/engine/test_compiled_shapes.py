"""Compiled layers (`training.compile_layers`) compile each graph once, whatever the micro-batch.

A tiny Llama (4 layers, padded rows, 3 rows a micro-batch) trains 3 steps through `verify`
with compiled layers; step 2's last micro-batch has one row fewer (its first dropped, the padded
row kept) and step 3's micro-batches are cut to a shorter padded length (20 of 24 tokens, the
last row still padded, so the mask stays a tensor: a micro-batch without padding has no mask,
which is another graph). Compiled with static shapes, dynamo compiled 2 graphs in step 1 (one
per grad mode: the no_grad forward, the recompute with its backward) and 2 more in each of
steps 2 and 3 (6 in all); with dynamic shapes (engine/slots.py `compile_dynamic`) the 2 of
step 1 serve every step, and the 4 layers share them.

Parity is verify's own judgement (megatrain/verify/judge.py): loss, every gradient and weight
against float64 PyTorch, within the fp32 tolerance scaled by fp32 PyTorch's own distance from
float64, the same check the compiled GPU test makes (tests/engine/test_gpu.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import megatrain.verify.run as verify_run
from megatrain.batch import Batch
from megatrain.verify import run_verify, verify_config, within

pytestmark = pytest.mark.slow  # inductor compiles on the CPU: tens of seconds

SHORT_LEN = 20  # of the 24 tokens a verify row has; its padded last row starts at 16


def _cut(batch: Batch, rows: slice, length: int) -> Batch:
    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows, :length].clone()

    return Batch(
        cut(batch.input_ids), cut(batch.labels), cut(batch.attention_mask), cut(batch.position_ids)
    )


def _varying_batches(*args: Any, **kwargs: Any) -> list[list[Batch]]:
    steps = _make_batches(*args, **kwargs)
    last = steps[1][-1]
    steps[1][-1] = _cut(last, slice(1, None), last.input_ids.shape[1])  # one row fewer
    steps[2] = [_cut(b, slice(None), SHORT_LEN) for b in steps[2]]  # a shorter padded length
    return steps


_make_batches = verify_run.make_batches


def test_compiled_layers_compile_once_for_short_and_shorter_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verify_run, "make_batches", _varying_batches)
    cfg = verify_config(
        None,
        ["--training.compile_layers", "true"],
        model_type="llama",
        tiny=True,
        batch_size=3,
        config_overrides={"num_hidden_layers": 4},
    )
    assert cfg.layout == "padded"
    torch._dynamo.reset()
    counters.clear()
    # hermetic: no inductor code and no dynamic dims dynamo recorded (its PGO) from an earlier
    # run. (An AVX-512 build from the cache, reused under ATEN_CPU_CAPABILITY=avx2, gave NaN.)
    with torch._inductor.config.patch(force_disable_caches=True):
        reports = run_verify(cfg, steps=3)
    assert within(reports), [(r.step, r.excess, r.worst) for r in reports]
    # one graph per grad mode for all 4 layers and all 3 steps; static shapes made 6
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert counters["frames"]["ok"] == 2, dict(counters["frames"])
