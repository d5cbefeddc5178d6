"""The CPU AdamW rate per state dtype follows the host's AdamW threads (planning/timing.py
`state_dtype_speed`, `Hardware.optimizer_threads`): fp32 flat, the compressed kernels faster
with more cores, a probe of the run's own kernel taken as it is, the default host unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from megatrain.config.shorthand import shorthand_config
from megatrain.distributed import Placement
from megatrain.planning import Hardware, model_spec
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import detect, probe
from megatrain.planning.optimizer_rate import (
    STATE_DTYPE_SPEED,
    optimizer_gparams_s,
    state_dtype_speed,
)
from megatrain.planning.report import format_estimate
from megatrain.threads import optimizer_threads
from predict import predict

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=4096,
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_the_default_host_keeps_the_measured_ratios(dtype: str) -> None:
    """At the 16-vCPU host's 14 threads (the default) the ratios to fp32 are the ones measured
    there: int8 at 0.60 x 5.2 = 3.12 Gparams/s."""
    assert Hardware().optimizer_threads == 14
    assert state_dtype_speed(dtype, 14) == STATE_DTYPE_SPEED[dtype]
    assert optimizer_gparams_s(Hardware(), dtype) == pytest.approx(5.2 * STATE_DTYPE_SPEED[dtype])


def test_int4_is_int8_times_its_measured_ratio_on_every_host() -> None:
    """int4's rate is int8's times the kernels' ratio measured on the development VM's CPU
    (1.15, planning/timing.py INT4_VS_INT8_CPU): 0.69 x 5.2 = 3.59 Gparams/s at 14 threads,
    and the same ratio at any thread count (int8's exponent, until an int4 run measures one)."""
    assert optimizer_gparams_s(Hardware(), "int4") == pytest.approx(0.60 * 1.15 * 5.2)
    for threads in (8, 14, 30, 62):
        hw = Hardware(optimizer_threads=threads)
        ratio = optimizer_gparams_s(hw, "int4") / optimizer_gparams_s(hw, "int8")
        assert ratio == pytest.approx(1.15)


def test_fp32_is_flat_and_the_compressed_kernels_grow_with_threads() -> None:
    rates = {
        dtype: [optimizer_gparams_s(Hardware(optimizer_threads=t), dtype) for t in (8, 14, 30, 62)]
        for dtype in ("fp32", "bf16", "int8")
    }
    assert rates["fp32"] == [5.2] * 4  # bandwidth-bound: the same on every host
    for dtype in ("bf16", "int8"):
        assert rates[dtype] == sorted(rates[dtype]) and rates[dtype][0] < rates[dtype][-1]


KERNEL_SPEEDUP = 1.46
"""The vectorised int8 kernel (run 46) against the one before it, on one host with a busy main
thread beside both, as the runs have (docs/performance.md run 46's A/B; 1.57 idle)."""


@pytest.mark.parametrize(
    ("dtype", "threads", "measured"),
    [
        ("int8", 14, 15.15 / 5.094),  # run 47: GPT-OSS-20B, 17 layers
        ("int8", 14, 13.80 / 4.142),  # run 47: Qwen3-Next-80B-A3B, 8 layers
        ("int8", 30, 20.91 / 3.953),  # run 48: GPT-OSS-20B, the 32-vCPU host
        ("int8", 30, 3.43 * KERNEL_SPEEDUP),  # run 43, the kernel before: Qwen3.5-27B
        ("int8", 30, 4.29 * KERNEL_SPEEDUP),  # run 43, the kernel before: Qwen3-Next, 19 layers
        ("int8", 62, 6.5 * KERNEL_SPEEDUP),  # run 19, the kernel before
        ("bf16", 30, 7.39),  # run 43
    ],
)
def test_the_compressed_rates_match_the_runs(dtype: str, threads: int, measured: float) -> None:
    """In-run rates (docs/performance.md: CPU AdamW busy time over the host blocks' parameters;
    no GPU tier) on the 16-, 32- and 64-vCPU hosts, from the default fp32 rate; issue 24's 25%.
    The int8 runs of runs 19 and 43 ran the kernel before run 46's: their rates are scaled by
    that kernel's measured speed-up, the assumption STATE_DTYPE_THREADS_EXPONENT states."""
    rate = optimizer_gparams_s(Hardware(optimizer_threads=threads), dtype)
    assert abs(rate / measured - 1) <= 0.25, rate


def test_a_probe_of_the_runs_kernel_is_not_scaled_and_one_of_fp32_is() -> None:
    int8_probe = Hardware(
        optimizer_gparams_s=3.0, optimizer_state_dtype="int8", optimizer_threads=62
    )
    assert optimizer_gparams_s(int8_probe, "int8") == 3.0  # measured on the run's threads
    fp32_probe = Hardware(optimizer_gparams_s=6.0, optimizer_threads=30)
    assert optimizer_gparams_s(fp32_probe, "int8") == pytest.approx(
        6.0 * state_dtype_speed("int8", 30)
    )
    # from one compressed kernel to the other: both speeds at the host's threads
    bf16 = optimizer_gparams_s(int8_probe, "bf16")
    assert bf16 == pytest.approx(
        3.0 * state_dtype_speed("bf16", 62) / state_dtype_speed("int8", 62)
    )


def test_the_step_time_uses_the_host_threads() -> None:
    spec = model_spec(Qwen2Config(**SHAPE))
    kwargs = dict(seq_len=512, micro_batch_size=1, padded=False, state_dtype="int8")
    slow = predict(spec, hardware=Hardware(), **kwargs)
    fast = predict(spec, hardware=Hardware(optimizer_threads=62), **kwargs)
    speedup = state_dtype_speed("int8", 62) / state_dtype_speed("int8", 14)
    assert slow.time.optimizer_s == pytest.approx(fast.time.optimizer_s * speedup)
    assert "3.12 Gparams/s, int8 states, 14 threads (fp32 5.20 assumed, scaled)" in (
        format_estimate(slow)
    )


def test_detect_and_probe_record_the_runs_thread_count() -> None:
    """detect(): the threads `megatrain train` gives the AdamW alone on this node, not torch's
    intra-op default (physical cores where the CPU reports two threads a core)."""
    hw = detect()
    assert hw.optimizer_threads == optimizer_threads(1)
    assert hw.source("optimizer_threads") == "measured"
    probed = probe(optimizer_params=25_000_000, optimizer_threads=1, state_dtype="bf16")
    assert probed.optimizer_threads == 1 and probed.optimizer_state_dtype == "bf16"


@pytest.mark.parametrize(("threads", "ranks", "expected"), [(None, 1, 30), (6, 1, 6), (6, 2, 12)])
def test_optimizer_threads_setting_is_the_node_count(
    threads: int | None, ranks: int, expected: int
) -> None:
    """optimizer.threads is each rank's: the node runs it on every one of its ranks."""
    values = {"model.model_type": "llama", "model.tiny": True, "optimizer.threads": threads}
    cfg = shorthand_config(None, values={k: v for k, v in values.items() if v is not None})
    placement = Placement(torch.device("cpu"), 0, ranks, 0, ranks)
    given = dataclasses.replace(Hardware(), optimizer_threads=30)
    hw = PlanBuilder(cfg, hardware=given, placement=placement).hardware
    assert hw.optimizer_threads == expected
    assert (hw.source("optimizer_threads") == "measured") == (threads is not None)
