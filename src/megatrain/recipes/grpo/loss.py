"""The GRPO objective as a per-token function of log-probs, in TRL GRPOTrainer's conventions.

For completion token t of sequence i (A_i its advantage, r = exp(logp - old_logp)):

    l_it = -min(r * A_i, clip(r, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * kl_it
    kl_it = exp(ref - logp) - (ref - logp) - 1          (k3 estimator; only when beta > 0)

With one iteration per generation batch the old log-probs are the current ones, detached (r = 1
in value, gradient A_i). The step's loss sums w_it * l_it with weights that carry each
`loss_type`'s normalisation over the whole generation batch (one optimizer step):

    grpo     w_it = 1 / (|o_i| * G)                  mean over sequences of per-sequence means
    dr_grpo  w_it = 1 / (G * max_completion_length)  a constant
    dapo     w_it = 1 / sum_i |o_i|                  mean over all completion tokens

(G = sequences in the batch, every rank's; |o_i| = completion tokens of sequence i, at least 1).
This is what TRL computes per micro-batch and divides by the accumulation steps (grpo, dr_grpo)
or by the global token count (dapo), summed over the accumulated micro-batches of equal size.

Truncated importance sampling (TIS, `importance_cap` C): when the completions were sampled from
weights kept in another precision than the trainer's (a compact rollout, model/quant_linear.py)
the policy-gradient term of each token is multiplied by

    rho_it = min(exp(old_logp - rollout_logp), C)        (detached: no gradient through it)

with rollout_logp the sampled token's log-prob under the rollout's model at the same
temperature (recipes/grpo/rollout.py Rollout.logps), as TRL's vllm_importance_sampling_correction
does per token ("token_truncate"); the KL term is not weighted (TRL adds it after).

Per-token inputs (names of `TokenObjective.inputs`): "advantages", "weights", and when used
"old_logps", "ref_logps", "rollout_logps"; each [B, S], aligned with the labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def weight_totals(completion_masks: list[torch.Tensor]) -> tuple[int, float]:
    """(sequences, completion tokens) of micro-batches: the denominators of `token_weights`."""
    return sum(m.shape[0] for m in completion_masks), sum(float(m.sum()) for m in completion_masks)


def token_weights(
    completion_masks: list[torch.Tensor],
    *,
    loss_type: str,
    max_completion_length: int,
    job_totals: tuple[int, float] | None = None,
) -> list[torch.Tensor]:
    """Per-token loss weights (fp32 [B, S], 0 off the completions) of a step's micro-batches.

    `completion_masks[k]` is 1 on micro-batch k's completion tokens (label alignment); every
    row is one sequence, and the normalisation spans the whole generation batch (one optimizer
    step): these micro-batches, or under several ranks `job_totals`, the (sequences, completion
    tokens) of every rank's micro-batches together (recipes/grpo/ranks.py), so that the ranks'
    losses add up to one process's.
    """
    masks = [m.to(torch.float32) for m in completion_masks]
    num_sequences, num_tokens = job_totals or weight_totals(masks)
    if loss_type == "grpo":
        return [m / (m.sum(1, keepdim=True).clamp(min=1.0) * num_sequences) for m in masks]
    if loss_type == "dr_grpo":
        return [m / (num_sequences * max_completion_length) for m in masks]
    if loss_type == "dapo":
        total = max(num_tokens, 1.0)
        return [m / total for m in masks]
    raise ValueError(f"grpo.loss_type={loss_type!r} must be one of {list(LOSS_TYPES)}")


def per_token_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    beta: float,
    epsilon: float,
    epsilon_high: float,
    importance: torch.Tensor | None = None,
) -> torch.Tensor:
    """l_t of the module docstring, elementwise; old_logp None: logp detached; `importance`:
    the TIS weights of the policy-gradient term (`truncated_importance`), None: none."""
    old = logp.detach() if old_logp is None else old_logp
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if importance is not None:
        loss = loss * importance
    if beta != 0.0:
        assert ref_logp is not None
        loss = loss + beta * k3_kl(logp, ref_logp)
    return loss


def truncated_importance(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float
) -> torch.Tensor:
    """rho = min(exp(old_logp - rollout_logp), cap): the trainer's over the rollout's probability of
    each sampled token, truncated (module docstring); 1 exactly where the two agree."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1: unbiased, non-negative estimate of KL(pi || ref)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1


@dataclass
class GRPOStats:
    """Sums over a step's completion tokens, for the step's metrics (no effect on the loss)."""

    tokens: int = 0
    kl_sum: float = 0.0
    clipped_low: int = 0
    clipped_high: int = 0
    importance_sum: float = 0.0  # TIS weights, summed (0 without TIS)
    importance_capped: int = 0  # tokens whose TIS ratio reached the cap
    # per chunk, on the device (read once, by `entropy`): the policy's entropy sums, in nats
    entropy_parts: list[torch.Tensor] = field(default_factory=list)

    @property
    def kl(self) -> float:
        return self.kl_sum / max(self.tokens, 1)

    @property
    def entropy(self) -> float:
        """Mean entropy of the next-token distribution over the completion tokens (TRL's
        `entropy`)."""
        total = float(torch.stack(self.entropy_parts).sum()) if self.entropy_parts else 0.0
        return total / max(self.tokens, 1)  # sync point: once per step, for the metrics

    @property
    def clip_ratio(self) -> float:
        return (self.clipped_low + self.clipped_high) / max(self.tokens, 1)

    @property
    def importance(self) -> float:
        """Mean TIS weight over the completion tokens (TRL's importance_sampling_ratio/mean)."""
        return self.importance_sum / max(self.tokens, 1)

    @property
    def importance_capped_share(self) -> float:
        return self.importance_capped / max(self.tokens, 1)


class GRPOLoss:
    """The chunk function of a `TokenObjective`: sum of weights * l_t over the chunk's tokens.

    Records the step's KL, clip counts and TIS weights in `stats` as it goes (detached values
    only). `importance_cap`: weight by TIS with that cap (needs "rollout_logps"); None: not.
    """

    def __init__(
        self,
        *,
        beta: float,
        epsilon: float,
        epsilon_high: float,
        use_old: bool,
        importance_cap: float | None = None,
    ) -> None:
        self.beta, self.epsilon, self.epsilon_high = beta, epsilon, epsilon_high
        self.use_old, self.importance_cap = use_old, importance_cap
        self.stats = GRPOStats()

    def __call__(self, logp_C: torch.Tensor, side: dict[str, torch.Tensor]) -> torch.Tensor:
        adv = side["advantages"]
        old = side["old_logps"] if self.use_old else None
        ref = side["ref_logps"] if self.beta != 0.0 else None
        importance = None
        if self.importance_cap is not None:
            base = logp_C.detach() if old is None else old
            importance = truncated_importance(base, side["rollout_logps"], self.importance_cap)
            self.stats.importance_sum += float(importance.sum())  # sync point: metrics only
            self.stats.importance_capped += int((importance >= self.importance_cap).sum())
        loss_C = per_token_loss(
            logp_C,
            adv,
            old_logp=old,
            ref_logp=ref,
            beta=self.beta,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            importance=importance,
        )
        self._record(logp_C.detach(), adv, old, ref)
        return (loss_C * side["weights"]).sum()

    def observe_logits(self, logits_CV: torch.Tensor) -> None:
        """Adds the chunk's entropies, H = logsumexp(z) - sum softmax(z) z, a few rows at a time
        (each slice's fp32 temporaries stay small beside the chunk's logits)."""
        total = torch.zeros((), dtype=torch.float64, device=logits_CV.device)
        rows = max(1, (64 << 20) // (4 * max(logits_CV.shape[-1], 1)))  # ~64 MiB per temporary
        for z in logits_CV.split(rows):
            lse = torch.logsumexp(z, -1)
            total += (lse - (torch.softmax(z, -1) * z).sum(-1)).double().sum()
        self.stats.entropy_parts.append(total)

    def _record(
        self,
        logp: torch.Tensor,
        adv: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> None:
        s = self.stats
        s.tokens += logp.numel()
        if ref is not None:
            s.kl_sum += float(k3_kl(logp, ref).sum())  # sync point: metrics only
        if old is not None:
            ratio = torch.exp(logp - old)
            s.clipped_low += int(((ratio < 1 - self.epsilon) & (adv < 0)).sum())  # sync point
            s.clipped_high += int(((ratio > 1 + self.epsilon_high) & (adv > 0)).sum())
