"""verify's verdict (verify/judge.py): each row prints the error judged and its bound."""

from __future__ import annotations

import torch

from megatrain.verify.judge import NOISE_FACTOR, TOLERANCES, StepReport, format_report, judge


def _group(**values: float) -> dict[str, torch.Tensor]:
    return {name: torch.tensor([v], dtype=torch.float64) for name, v in values.items()}


def test_a_row_prints_the_bound_its_worst_tensor_is_held_to() -> None:
    tol = TOLERANCES["fp32"]
    exact = {"loss": _group(loss=1.0), "grad": _group(a=1.0, b=1.0), "weight": _group(w=1.0)}
    # tensor a: engine 2e-5 off where PyTorch's fp32 run is 1e-5 off: allowed 10 x 1e-5 = 1e-4
    ours = {"loss": _group(loss=1.0), "grad": _group(a=1 + 2e-5, b=1.0), "weight": _group(w=1.0)}
    noisy = {"loss": _group(loss=1.0), "grad": _group(a=1 + 1e-5, b=1.0), "weight": _group(w=1.0)}
    excess, worst, error, bound = judge(ours, exact, noisy, tol, per_tensor=True)
    assert worst == "grad a"
    assert abs(error - 2e-5) < 1e-9 and abs(bound - NOISE_FACTOR * 1e-5) < 1e-9
    assert abs(excess - 0.2) < 1e-4  # 2e-5 / 1e-4: above the 1e-5 floor, and still a pass
    report = StepReport(1, 1.0, 1.0, 0.0, error, 0.0, 1.0, False, excess, worst, error, bound)
    table = format_report([report], tol)
    row = table.splitlines()[1].split()
    assert (
        row[-3:]
        == [f"{error:.2e}", f"{bound:.2e}", f"{excess:.3f}"]
        == ["2.00e-05", "1.00e-04", "0.200"]
    )
    assert "bound: the error allowed there, max(tolerance, 10 x fp32 PyTorch's own error)" in table
