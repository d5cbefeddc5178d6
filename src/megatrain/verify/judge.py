"""How verify decides pass or fail: relative errors, the tolerances and the noise allowance.

See megatrain/verify/__init__.py for the criterion. Errors are ||a - b|| / ||b|| per tensor
(fp32 compute) or over the whole model (bf16 compute); "excess" = error / allowed, <= 1 passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Error always allowed, before the 10x-PyTorch-noise allowance (module docstring).
TOLERANCES = {
    "fp32": {"loss": 1e-5, "grad": 1e-5, "weight": 1e-5},
    "bf16": {"loss": 1e-3, "grad": 1e-2, "weight": 1e-3},
}
NOISE_FACTOR = 10.0
# Routing decisions must keep this relative margin (package docstring). An engine within the
# fp32 tolerance 1e-5 of the target moves each top-k input by at most 1e-5 of the row's scale,
# so the gap between two of them by at most 2e-5: below that, rounding could pick the expert.
MIN_ROUTING_MARGIN = 2 * TOLERANCES["fp32"]["grad"]


@dataclass
class StepReport:
    step: int
    loss: float
    ref_loss: float
    loss_rel: float  # engine vs plain PyTorch in fp32, relative
    grad_rel: float  # max over tensors, ||engine - torch|| / ||torch||, before clipping
    weight_rel: float  # same, weights after the update
    grad_norm: float
    clipped: bool
    excess: float  # worst error / allowed error over loss, gradients, weights; <= 1 passes
    worst: str  # where `excess` occurs
    error: float = 0.0  # the engine's error against the exact target where `excess` occurs
    bound: float = 0.0  # the error allowed there: max(tolerance, NOISE_FACTOR x PyTorch's)
    random_off: dict[str, float] = field(default_factory=dict)  # dropout/jitter set to 0
    routing_margin: float | None = None  # smallest top-k margin of the float64 run (MoE, fp32)
    data_seed: int = 0  # seed of the random micro-batches


def judge(
    ours: dict[str, dict[str, torch.Tensor]],
    exact: dict[str, dict[str, torch.Tensor]],
    noisy: dict[str, dict[str, torch.Tensor]] | None,
    tol: dict[str, float],
    per_tensor: bool,
) -> tuple[float, str, float, float]:
    """(excess, where, the engine's error there, the error allowed there): the worst ratio of
    error to allowed over the loss, gradients and weights."""
    verdict = (0.0, "", 0.0, 0.0)
    for kind in ("loss", "grad", "weight"):
        group = rel_errors if per_tensor else _global_rel_error
        errs = group(ours[kind], exact[kind])
        noise_errs = group(noisy[kind], exact[kind]) if noisy is not None else None
        e, where, error, bound = _excess(errs, noise_errs, tol[kind])
        if e >= verdict[0]:
            verdict = (e, f"{kind} {where}", error, bound)
    return verdict


def rel_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """||a - b|| / ||b|| per tensor (inf for NaN)."""
    out = {}
    for name, r in ref.items():
        r = r.detach().double().cpu()
        diff = float(torch.linalg.vector_norm(ours[name].double().cpu() - r))
        rel = diff / max(float(torch.linalg.vector_norm(r)), 1e-30)
        out[name] = math.inf if math.isnan(rel) else rel
    return out


def _global_rel_error(
    ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> dict[str, float]:
    """||a - b|| / ||b|| with every tensor of the group concatenated into one vector."""
    diff_sq = sum(
        float((ours[n].double().cpu() - r.double().cpu()).square().sum()) for n, r in ref.items()
    )
    ref_sq = sum(float(r.double().square().sum()) for r in ref.values())
    rel = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30)
    return {"all": math.inf if math.isnan(rel) else rel}


def _excess(
    engine_err: dict[str, float], noise_err: dict[str, float] | None, tol: float
) -> tuple[float, str, float, float]:
    """Worst ratio of the engine's error to what is allowed, the tensor it occurs in, and
    that tensor's error and allowance.

    Allowed: `tol`, or NOISE_FACTOR x the error plain PyTorch makes in the same precision
    (`noise_err`, when measured): see the module docstring.
    """
    worst: tuple[float, str, float, float] = (0.0, "", 0.0, 0.0)
    for name, err in engine_err.items():
        allowed = tol if noise_err is None else max(tol, NOISE_FACTOR * noise_err[name])
        ratio = err / allowed
        if math.isnan(ratio):
            ratio = math.inf
        if ratio > worst[0] or math.isinf(ratio) or not worst[1]:
            worst = (ratio, name, err, allowed)
    return worst


def format_report(reports: list[StepReport], tol: dict[str, float]) -> str:
    lines = [
        f"{'step':>4} {'loss':>10} {'torch loss':>10} {'loss rel':>9} {'grad rel':>9} "
        f"{'weight rel':>10} {'grad norm':>9} {'clipped':>7} {'error':>9} {'bound':>9} "
        f"{'excess':>7}"
    ]
    for r in reports:
        lines.append(
            f"{r.step:>4} {r.loss:>10.6f} {r.ref_loss:>10.6f} {r.loss_rel:>9.2e} "
            f"{r.grad_rel:>9.2e} {r.weight_rel:>10.2e} {r.grad_norm:>9.4f} "
            f"{'yes' if r.clipped else 'no':>7} {r.error:>9.2e} {r.bound:>9.2e} {r.excess:>7.3f}"
        )
    worst = max(reports, key=lambda r: r.excess)
    first = reports[0]
    if first.random_off:
        keys = ", ".join(f"{k}={v:g}" for k, v in first.random_off.items())
        lines.append(
            f"dropout/jitter off on both sides ({keys} -> 0): random masks cannot be compared "
            "across two implementations; training keeps them, with the forward's masks reused "
            "in the backward recompute"
        )
    if first.routing_margin is not None:
        flag = "" if first.routing_margin >= MIN_ROUTING_MARGIN else " (a near-tie: may flip)"
        lines.append(
            f"routing: smallest relative top-k margin {first.routing_margin:.1e}{flag}, "
            f"data seed {first.data_seed}"
        )
    lines.append(
        "rel: the engine against fp32 PyTorch, the largest over tensors; error: the engine "
        "against the exact target at its worst tensor, bound: the error allowed there, "
        f"max(tolerance, {NOISE_FACTOR:g} x fp32 PyTorch's own error), with tolerance loss "
        f"{tol['loss']:.0e}, grad {tol['grad']:.0e}, weight {tol['weight']:.0e}; excess = "
        f"error / bound (<= 1 passes); worst at step {worst.step}: {worst.worst}"
    )
    return "\n".join(lines)


def within(reports: list[StepReport]) -> bool:
    return all(r.excess <= 1.0 for r in reports)
