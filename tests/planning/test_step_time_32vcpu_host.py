"""The step time (and GPT-OSS-20B's GPU peak) of docs/performance.md run 43 (one H100 of the
2-GPU machine, whose host has 32 vCPUs, so 30 CPU AdamW threads, and 251 GiB), as the
estimator sees it with that host's thread count: 64k tokens a step (32 pre-training rows of
2048, micro-batch 4), clipping 1.0, bf16, compressed AdamW states (no GPU tier then: every block
updated by the CPU). Issue 24's bound: the step within 25% of the measured one; the CPU AdamW
busy time and, where updates gate the next forward, the host's wait for them within the same.
A check of the model against recorded measurements, not a timing of this machine.

Before the host's threads and eager attention's whole score matrix were modelled, the same
plans predicted 9.50, 38.63 and 18.94 s (GPT-OSS 19% under, Qwen3.5 14% and Qwen3-Next 39%
over; `megatrain train` printed 9.57, 38.86 and 19.28)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from fake_fla import run_with_fake_fla
from megatrain.planning.estimate import Estimate
from megatrain.planning.hardware import GIB, Hardware
from predict import cli_row_plan
from shapes import GPT_OSS_20B

HOST_32 = dict(optimizer_threads=30)
OLD_INT8 = 0.45 * 5.2 * (30 / 14) ** 0.67
"""The int8 rate the model gave the kernel these runs ran (the one before docs/performance.md
run 46's) on this host's 30 threads: 3.90 Gparams/s. The int8 rows take it as a probe of that
kernel, so they check the step model, not the refitted rate (tests/planning/
test_optimizer_threads.py checks that)."""
HOST_32_GIB = dict(gpu_gib=79.2, host_gib=251)
WITHIN = 0.25  # issue 24


def _off(predicted: float, measured: float) -> float:
    return abs(predicted / measured - 1)


def _gpt_oss_20b_row(
    settings: dict[str, str], measured: tuple[float, ...], allocated_within: float
) -> Estimate:
    """The whole GPT-OSS-20B's plan on this host against a run's step, CPU AdamW busy time and
    the next forward's wait for it (s; within 25%), and its allocated (within
    `allocated_within`) and reserved (10%) GPU peak (GiB)."""
    hw = Hardware(**HOST_32).with_overrides(**HOST_32_GIB)
    estimate = cli_row_plan(GPT_OSS_20B, hw, **settings).estimate
    time, gpu = estimate.time, estimate.gpu
    step, optimizer, wait, allocated, reserved = measured
    assert _off(time.step_s, step) <= WITHIN, time.step_s
    assert _off(time.optimizer_s, optimizer) <= WITHIN, time.optimizer_s
    assert _off(time.wait_optimizer_s, wait) <= WITHIN, time.wait_optimizer_s
    assert _off(gpu.allocated_bytes / GIB, allocated) <= allocated_within, gpu.allocated_bytes
    assert _off(gpu.peak_bytes / GIB, reserved) <= 0.10, gpu.peak_bytes / GIB
    return estimate


def test_gpt_oss_20b_with_eager_attention_and_bf16_states() -> None:
    """11.766 s a step measured, CPU AdamW 2.829 s (bf16 kernel 7.39 Gparams/s), the next
    forward waiting 2.287 s for updates; GPU backward (recompute + backward) 7.94 s. Its
    attention runs eager (sinks): the whole [S, S] scores, counted in full when compiled, and
    held longer by the compiled layer (planning/estimate.py COMPILED_EAGER_SCORES). Run 43 ran
    before sdpa with sinks became GPT-OSS's default (model/sink_attention.py): the row pins
    the eager attention it measured. GPU peak 41.21 GiB allocated, 44.61 reserved; compiled,
    its eager attention keeps COMPILED_EAGER_SCORES more score tensors than the eager profile
    (allocated within 10%)."""
    settings = {
        "optimizer.state_dtype": "bf16",
        "memory.gpu_state_blocks": 0,
        "model.attn_implementation": "eager",
    }
    _gpt_oss_20b_row(settings, (11.766, 2.829, 2.287, 41.21, 44.61), allocated_within=0.10)


def test_gpt_oss_20b_with_int8_states_on_the_vectorised_kernel() -> None:
    """docs/performance.md run 48 (the same machine kind, alone on it): the whole GPT-OSS-20B
    with its sinks default and int8 states, run 46's int8 kernel: 9.195 s a step, CPU AdamW
    3.953 s (5.29 Gparams/s on 30 threads: the refitted int8 rate and its thread exponent
    together), the next forward waiting 3.466 s; 29.03 GiB allocated and 31.49 reserved at
    the peak, 158.7 GiB host RSS."""
    measured = (9.195, 3.953, 3.466, 29.03, 31.49)
    estimate = _gpt_oss_20b_row(
        {"optimizer.state_dtype": "int8", "memory.gpu_state_blocks": 0},
        measured,
        allocated_within=0.05,
    )
    assert _off(estimate.host.total_bytes / GIB, 158.7) <= 0.05, estimate.host.total_bytes


_FLA_ROWS = textwrap.dedent(
    f"""
    from megatrain.planning.hardware import Hardware
    from predict import cli_row_plan
    from shapes import QWEN3_NEXT_80B_A3B_19, QWEN35_27B

    hw = Hardware(
        **{HOST_32}, optimizer_gparams_s={OLD_INT8}, optimizer_state_dtype="int8"
    ).with_overrides(**{HOST_32_GIB})
    for name, shape in (("qwen35", QWEN35_27B), ("next", QWEN3_NEXT_80B_A3B_19)):
        untiered = {{"optimizer.state_dtype": "int8", "memory.gpu_state_blocks": 0}}  # as run
        time = cli_row_plan(shape, hw, **untiered).estimate.time
        print(name, time.step_s, time.optimizer_s, time.wait_optimizer_s)
    """
)


def test_int8_rows_with_flash_linear_attention(tmp_path: Path) -> None:
    """Both hybrid rows ran with flash-linear-attention installed (its calls count as fused
    kernels) and int8 states: the Qwen3.5-27B shape, all 64 layers (26.90B), 33.866 s a step,
    CPU AdamW 7.842 s (3.43 Gparams/s); the Qwen3-Next-80B-A3B shape cut to 19 layers (31.92B,
    every layer 512 experts), 13.614 s, CPU AdamW 7.443 s (4.29 Gparams/s), waited for 6.557 s.
    Qwen3.5's wait (3.07 s measured) is not checked: the replay's host runs further ahead of a
    GPU-bound step than the engine's and waits about twice as long."""
    out = run_with_fake_fla(tmp_path, _FLA_ROWS)
    rows = {name: [float(v) for v in rest] for name, *rest in map(str.split, out.splitlines())}
    step, optimizer, _ = rows["qwen35"]
    assert _off(step, 33.866) <= WITHIN, step
    assert _off(optimizer, 7.842) <= WITHIN, optimizer
    step, optimizer, wait = rows["next"]
    assert _off(step, 13.614) <= WITHIN, step
    assert _off(optimizer, 7.443) <= WITHIN, optimizer
    assert _off(wait, 6.557) <= WITHIN, wait
