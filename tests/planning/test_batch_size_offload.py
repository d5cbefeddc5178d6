"""`training.micro_batch_size: auto` where the step's layer inputs do not fit on the GPU even at
one row a micro-batch: with memory.activation_offload allowed, the micro-batch is picked with
the inputs on the host (the long-rows plan then keeps on the GPU what fits beside it), as a
user setting a micro-batch by hand gets; with it "off", the error says what to change.

Llama-3.1-8B's shape on the test suite's H100 host, rows of 2048 tokens, 256 micro-batches a
step: the inputs alone are 32 layers x 256 x 2048 x 4096 x 2 B = 128 GiB at one row each."""

from __future__ import annotations

from typing import Any

import pytest

from megatrain.planning.hardware import Hardware
from predict import cli_row_plan
from shapes import LLAMA31_8B

H100 = Hardware().with_overrides(gpu_gib=79.2, host_gib=512)
ROWS = {"model_type": "llama", **LLAMA31_8B}


def _plan(offload: str, micro: int | str) -> Any:
    return cli_row_plan(
        ROWS,
        H100,
        **{
            "training.micro_batch_size": micro,
            "training.gradient_accumulation_steps": 256,
            "memory.activation_offload": offload,
        },
    )


def test_auto_offloads_the_inputs_where_none_fits_on_the_gpu() -> None:
    auto = _plan("auto", "auto")
    assert auto.micro_batch_size >= 1 and auto.estimate.host.offload_bytes > 0
    assert not auto.problems  # it fits, inputs on both sides
    assert "layer inputs on the host" in auto.batch_reason
    hand = _plan("auto", auto.micro_batch_size)  # the same size set by hand plans the same
    assert hand.engine == auto.engine and hand.estimate.time.step_s == auto.estimate.time.step_s


def test_without_offload_no_micro_batch_fits() -> None:
    with pytest.raises(ValueError, match=r"no micro-batch size fits, not even 1"):
        _plan("off", "auto")
