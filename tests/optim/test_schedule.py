"""Learning-rate schedules: shapes, warmup, floor, errors."""

from __future__ import annotations

import itertools
import math

import pytest

from megatrain.optim.schedule import LRSchedule, warmup_steps_for


def test_warmup_then_cosine_to_floor() -> None:
    s = LRSchedule(peak_lr=1.0, total_steps=12, kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    lrs = [s.lr_at(i) for i in range(12)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[-1] == pytest.approx(0.1)
    mid = 2 + (12 - 1 - 2) / 2
    assert s.lr_at(int(mid)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))


def test_linear_and_constant() -> None:
    lin = LRSchedule(peak_lr=2.0, total_steps=5, kind="linear")
    assert [lin.lr_at(i) for i in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    const = LRSchedule(peak_lr=2.0, total_steps=5, kind="constant", warmup_steps=4)
    assert [const.lr_at(i) for i in range(5)] == [0.5, 1.0, 1.5, 2.0, 2.0]


def test_warmup_ratio_and_errors() -> None:
    assert warmup_steps_for(100, 0, 0.05) == 5
    assert warmup_steps_for(100, 7, 0.0) == 7
    with pytest.raises(ValueError, match="lr_scheduler"):
        LRSchedule(peak_lr=1.0, total_steps=3, kind="step")
    with pytest.raises(ValueError, match="optimizer steps"):
        LRSchedule(peak_lr=1.0, total_steps=0)
