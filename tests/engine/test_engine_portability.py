"""Parity does not depend on the machine: the same cases under the C AdamW kernel and the torch
fallback, and under thread counts other than the default (torch's and the kernel's).

The issue this guards against: tolerances tuned on one CPU, and a test that passed only because
the kernel and thread count of that machine happened to round one way.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.verify import MIN_ROUTING_MARGIN, run_verify, verify_config, within

IMPLS = ["torch"] + (["c"] if load_adamw_kernel() is not None else [])


@pytest.fixture
def optimizer_impl(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """The AdamW implementation `auto` resolves to: the C kernel, or the torch fallback."""
    if request.param == "torch":
        monkeypatch.setenv("MEGATRAIN_NO_C_KERNEL", "1")
    load_adamw_kernel.cache_clear()
    yield request.param
    load_adamw_kernel.cache_clear()


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)  # also the kernel's thread count (CpuAdamW default)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("optimizer_impl", IMPLS, indirect=True)
@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_parity_with_each_optimizer_and_thread_count(
    model_type: str, optimizer_impl: str, threads: int
) -> None:
    assert CpuAdamW(AdamWHyper()).impl == optimizer_impl
    threads_key = ["--optimizer.threads", str(threads)]  # the kernel's threads; torch's above
    reports = run_verify(verify_config(None, threads_key, model_type=model_type, tiny=True))
    detail = [(r.step, r.excess, r.worst) for r in reports]
    assert within(reports), detail
    assert all(r.clipped for r in reports[:1])
    margins = [r.routing_margin for r in reports if r.routing_margin is not None]
    assert all(m >= MIN_ROUTING_MARGIN for m in margins), margins
    assert (model_type == "mixtral") == bool(margins)
