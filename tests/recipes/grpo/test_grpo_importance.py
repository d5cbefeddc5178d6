"""Truncated importance sampling (recipes/grpo/loss.py): the weights min(exp(old - rollout), C),
applied to the policy-gradient term only, and a loss unchanged bit for bit where the rollout's
log-probs are the trainer's (the same precision)."""

from __future__ import annotations

import math

import pytest
import torch

from megatrain.recipes.grpo.loss import GRPOLoss, k3_kl, truncated_importance

EPS, EPS_HIGH, BETA, CAP = 0.2, 0.28, 0.04, 2.0


def test_weights_are_the_ratio_truncated_at_the_cap() -> None:
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0])
    rollout = old - torch.tensor([0.0, math.log(1.5), math.log(3.0), -1.0, 0.75])
    rho = truncated_importance(old, rollout, CAP)
    expected = torch.tensor([1.0, 1.5, CAP, math.exp(-1.0), CAP])  # exp(0.75) = 2.117 > 2
    assert torch.allclose(rho, expected, rtol=2**-22, atol=0.0)  # float32 exp, one rounding
    assert rho[0] == 1.0  # exactly 1 where the two agree


def _chunk() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(12, generator=gen) * 4).requires_grad_()
    side = {
        "advantages": torch.randn(12, generator=gen),
        "weights": torch.rand(12, generator=gen) / 12,
        "old_logps": logp.detach() + 0.3 * torch.randn(12, generator=gen),
        "ref_logps": logp.detach() + 0.1 * torch.randn(12, generator=gen),
    }
    return logp, side


@pytest.mark.parametrize("use_old", [False, True])
def test_same_precision_leaves_the_loss_unchanged_bit_for_bit(use_old: bool) -> None:
    """Rollout log-probs equal to the trainer's old ones: every weight is exp(0) = 1 exactly,
    so the loss and its gradient are the uncorrected ones to the bit."""
    logp, side = _chunk()
    base = side["old_logps"] if use_old else logp.detach()
    results = []
    for cap, extra in ((None, {}), (CAP, {"rollout_logps": base.clone()})):
        fn = GRPOLoss(beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH, use_old=use_old,
                      importance_cap=cap)  # fmt: skip
        loss = fn(logp, side | extra)
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss, grad, fn.stats))
    (loss0, grad0, _), (loss1, grad1, stats) = results
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)
    assert stats.importance == 1.0 and stats.importance_capped == 0


def test_weights_scale_the_policy_gradient_term_not_the_kl() -> None:
    """With old log-probs (num_iterations > 1): the loss is TRL's per-token loss with the
    clipped surrogate times rho, plus beta x k3 KL, weighted and summed (float64 reference)."""
    logp, side = _chunk()
    gen = torch.Generator().manual_seed(1)
    side["rollout_logps"] = side["old_logps"] + 0.8 * torch.randn(12, generator=gen)
    fn = GRPOLoss(beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH, use_old=True, importance_cap=CAP)
    loss = fn(logp, side)
    d = {k: v.double() for k, v in side.items()}
    lp = logp.detach().double()
    ratio = torch.exp(lp - d["old_logps"])
    surrogate = -torch.min(
        ratio * d["advantages"], ratio.clamp(1 - EPS, 1 + EPS_HIGH) * d["advantages"]
    )
    rho = torch.exp(d["old_logps"] - d["rollout_logps"]).clamp(max=CAP)
    kl = BETA * k3_kl(lp, d["ref_logps"])
    expected = (d["weights"] * (surrogate * rho + kl)).sum()
    # float32 against float64: 12 terms, a few roundings each (2^-24 relative) of sum |terms|
    scale = (d["weights"] * ((surrogate * rho).abs() + kl)).sum()
    assert abs(float(loss.detach()) - float(expected)) <= 64 * 2**-24 * float(scale)
    assert 0 < fn.stats.importance_capped < 12  # the cap is reached by some tokens, not all
    assert fn.stats.importance == pytest.approx(float(rho.mean()), rel=1e-6)
