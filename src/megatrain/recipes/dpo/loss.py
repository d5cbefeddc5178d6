"""Preference losses of sequence log-probs, in TRL's formulas and names (pure; no engine).

Inputs are per row: `logps` the sum of the row's completion-token log-probs under the policy,
`counts` its completion tokens, `ref_logps` the same sum under the reference (None for the
reference-free losses). DPO rows are interleaved: row 2k is pair k's chosen completion, row
2k + 1 its rejected one. With pi = logp(chosen) - logp(rejected), rho = the same under the
reference, and z = pi - rho:

    sigmoid  -(1 - ls) log s(beta z) - ls log s(-beta z)                  TRL DPOTrainer
    robust   ((1 - ls) (-log s(beta z)) + ls log s(-beta z)) / (1 - 2 ls)
    hinge    relu(1 - beta z)
    ipo      (z - 1 / (2 beta))^2                         logps averaged over the completion
    simpo    -(1 - ls) log s(beta (pi - gamma / beta)) - ls log s(-beta (...))   TRL CPOTrainer,
             logps averaged, no reference; rewards beta * logp
    orpo     -beta log s(log odds(chosen) - log odds(rejected)), odds(p) = p / (1 - p) of the
             averaged logps, no reference; plus the NLL term with weight 1   TRL ORPOTrainer
    kto      per row: 1 - s(beta (r - kl)) when desirable, 1 - s(beta (kl - r)) when not,
             r = logp - ref_logp, weighted by desirable/undesirable_weight   TRL KTOTrainer

(s the logistic function, ls = label_smoothing.) The step's loss is the mean of these over the
step's pairs (KTO: rows), plus `rpo_alpha` (orpo: 1) times the NLL of the chosen completions,
-sum(chosen logps) / chosen tokens: TRL's `rpo_alpha` (DPO) / `cpo_alpha` (SimPO), LLaMA-Factory's
`pref_ftx`. Rewards are beta * (logp - ref_logp) (the reference-free losses: beta * logp), with
the averaged logps where the loss averages.

Invariant: every step-level mean divides by the totals given (`num_pairs`, `chosen_tokens`), not
by this call's share, so the sum of the calls of one step over micro-batches and ranks is the
step's loss exactly as TRL computes it on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatrain.config.dpo import LOSS_TYPES

REFERENCE_FREE = ("orpo", "simpo")
AVERAGED = ("ipo", "orpo", "simpo")  # losses of the per-token mean log-prob


@dataclass(frozen=True)
class LossSettings:
    """The loss's parameters, TRL's names (docs in config/dpo.py)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclass
class StepTotals:
    """Counts over the whole step (every micro-batch, every rank): the means' denominators."""

    num_pairs: int  # pairs (dpo) or rows (kto)
    chosen_tokens: int  # completion tokens of the chosen rows (the NLL term's mean)


def preference_loss(
    logps: torch.Tensor,
    counts: torch.Tensor,
    ref_logps: torch.Tensor | None,
    settings: LossSettings,
    totals: StepTotals,
    *,
    desirable: torch.Tensor | None = None,
    kl: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this share of the step's loss, per-row/pair metric tensors: detached sums)."""
    s = settings
    counts = counts.to(logps.dtype)
    policy = logps / counts if s.loss_type in AVERAGED else logps
    ref = None
    if s.loss_type not in REFERENCE_FREE:
        assert ref_logps is not None, f"loss_type {s.loss_type!r} needs reference log-probs"
        ref = ref_logps / counts if s.loss_type in AVERAGED else ref_logps
    if s.loss_type == "kto":
        assert desirable is not None and ref is not None
        return _kto(policy, ref, desirable, s, totals, kl)
    chosen, rejected = policy[0::2], policy[1::2]
    losses = _pair_losses(chosen, rejected, ref, s)
    loss = losses.sum() / totals.num_pairs
    nll_weight = 1.0 if s.loss_type == "orpo" else s.rpo_alpha
    if nll_weight:
        loss = loss - nll_weight * logps[0::2].sum() / totals.chosen_tokens
    rewards = s.beta * (policy if ref is None else policy - ref)
    return loss, _metrics(rewards[0::2], rewards[1::2], chosen, rejected)


def _pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, ref: torch.Tensor | None, s: LossSettings
) -> torch.Tensor:
    pi = chosen - rejected
    z = pi if ref is None else pi - (ref[0::2] - ref[1::2])
    ls, beta = s.label_smoothing, s.beta
    if s.loss_type == "sigmoid":
        return -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
    if s.loss_type == "robust":
        return (-F.logsigmoid(beta * z) * (1 - ls) + F.logsigmoid(-beta * z) * ls) / (1 - 2 * ls)
    if s.loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if s.loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    if s.loss_type == "simpo":
        logits = pi - s.simpo_gamma / beta
        return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    if s.loss_type == "orpo":
        log_odds = pi - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        return -beta * F.logsigmoid(log_odds)
    raise ValueError(f"dpo.loss_type={s.loss_type!r} must be one of {list(LOSS_TYPES)}")


def _kto(
    policy: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    s: LossSettings,
    totals: StepTotals,
    kl: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = policy - ref
    good = desirable.bool()
    losses = torch.where(
        good,
        s.desirable_weight * (1 - torch.sigmoid(s.beta * (ratio - kl))),
        s.undesirable_weight * (1 - torch.sigmoid(s.beta * (kl - ratio))),
    )
    rewards = s.beta * ratio
    metrics = _metrics(rewards[good], rewards[~good], policy[good], policy[~good], pairs=False)
    return losses.sum() / totals.num_pairs, metrics


def _metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    pairs: bool = True,
) -> dict[str, torch.Tensor]:
    """Sums (the recipe divides by the step's pairs or rows): TRL's metric names; accuracies
    and margins of pairs only (KTO's desirable and undesirable rows are not pairs)."""
    out = {
        "rewards/chosen": chosen_rewards.detach().sum(),
        "rewards/rejected": rejected_rewards.detach().sum(),
        "logps/chosen": chosen.detach().sum(),
        "logps/rejected": rejected.detach().sum(),
    }
    if pairs:
        margin = (chosen_rewards - rejected_rewards).detach()
        out["rewards/accuracies"] = (margin > 0).to(margin.dtype).sum()
        out["rewards/margins"] = margin.sum()
    return out
