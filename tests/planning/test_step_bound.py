"""The bound the plan prints (planning/step_bound.py): GPU compute only where the GPU is
busy for GPU_BUSY_BOUND of the step, else the busiest resource that leaves it idle."""

from __future__ import annotations

import pytest

from megatrain.planning.step_bound import GPU_BUSY_BOUND, busy_share, step_bound

OTHERS = {"CPU optimizer": 1.83, "PCIe (H2D)": 0.75, "host (kernel launches)": 0.2}


def test_a_gpu_busy_for_most_of_the_step_bounds_it() -> None:
    assert step_bound(GPU_BUSY_BOUND, OTHERS) == "GPU compute"


@pytest.mark.parametrize("busy_s", [4.145 + 0.069, 0.5])
def test_a_gpu_left_idle_names_what_it_waits_on(busy_s: float) -> None:
    # GPT-OSS-20B, 17 layers, int8 states, clipping, on an H200 (the printed plan before this
    # rule said "GPU compute" for 5.35 s, of which the next forward waited 1.76 s for updates):
    # the CPU's update is busy for less than the GPU yet leaves it idle a fifth of the step
    busy = busy_share(busy_s, 0.0, 5.349)
    assert step_bound(busy, OTHERS) == "CPU optimizer"
    assert step_bound(busy, {**OTHERS, "PCIe (H2D)": 2.0}) == "PCIe (H2D)"
