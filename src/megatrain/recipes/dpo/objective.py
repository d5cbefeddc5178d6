"""A preference loss as the engine's `TokenObjective`: one log-prob pass, then a weighted one.

The loss (loss.py) is a non-linear function of per-row sums of completion-token log-probs, so
it cannot be a per-token `fn` alone. Per step, inside the engine's loss phase:

1. `prepare` gets every micro-batch's per-token log-probs (label-aligned, the head run once
   without gradients over the step's hidden states; never full logits), sums them per row,
   computes the loss in float64 on those B sums and differentiates it: g_r = d loss / d sum_r.
2. Each token t of row r is given the weight w_t = g_r; `__call__` (the chunk function of the
   head's fused forward-backward) returns sum_t w_t (logp_t - stop_grad(logp_t)): zero in value,
   gradient exactly w_t per token, so the head and every layer below receive d loss / d logp
   through the engine's usual weighted backward. The step's loss is the value `prepare` returns.

Reference log-probs (`sequence_logps` of `StreamingEngine.logprobs` of the initial weights,
computed once before training) enter as per-row sums; reference-free losses take None.

KTO: rows 2k are the labelled rows (`desirable`: one flag per row 2k), rows 2k + 1 their KL rows
(the same prompt, another row's completion, TRL's KL data set), whose log-probs only set the
reference point: the mean over the step's KL rows, every rank's (the sum and the count of each
rank's summed over the ranks in `prepare`, a collective every rank reaches once per step or eval
pass), so several ranks give one process's kl. A rank whose pass is a repeat (eval: `counted`
False) adds nothing to it.

Invariant: a row's mask is its labels (supervised positions, the first one excluded as the
engine shifts them), never the log-probs' zeros; rows 2k and 2k + 1 of a micro-batch are pair k.
"""

from __future__ import annotations

import torch

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.distributed import rank_sums
from megatrain.engine.head import TokenObjective
from megatrain.recipes.dpo.loss import LossSettings, StepTotals, preference_loss


def target_mask(batch: Batch) -> torch.Tensor:
    """fp32 [B, S]: 1 where labels[t] is a target (t >= 1: position 0 predicts nothing)."""
    mask = (batch.labels != IGNORE_INDEX).to(torch.float32)
    mask[:, 0] = 0.0
    return mask


def sequence_logps(logps: list[torch.Tensor], batches: list[Batch]) -> list[torch.Tensor]:
    """Per micro-batch, fp32 [B]: each row's sum of target log-probs (label-aligned input)."""
    return [(lp * target_mask(b)).sum(-1) for lp, b in zip(logps, batches, strict=True)]


class PreferenceObjective:
    """The step's preference loss for the engine; `metrics` holds its last step's sums."""

    def __init__(
        self,
        batches: list[Batch],
        settings: LossSettings,
        totals: StepTotals,
        *,
        ref_logps: list[torch.Tensor] | None,
        desirable: list[torch.Tensor] | None = None,
    ) -> None:
        self.masks = [target_mask(b) for b in batches]
        self.settings, self.totals = settings, totals
        self.ref = None if ref_logps is None else torch.cat(ref_logps).double()
        self.desirable = None if desirable is None else torch.cat(desirable).bool()
        self.metrics: dict[str, float] = {}
        self.counted = True  # KTO: this rank's KL rows count in the step's reference point

    def objective(self) -> TokenObjective:
        return TokenObjective(self, [{} for _ in self.masks], prepare=self.prepare)

    def prepare(
        self, logps: list[torch.Tensor]
    ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """(per micro-batch {"dlogp": d loss / d logp per token}, the loss value)."""
        sums = torch.cat([(lp * m).sum(-1) for lp, m in zip(logps, self.masks, strict=True)])
        counts = torch.cat([m.sum(-1) for m in self.masks]).double()
        leaf = sums.double().requires_grad_(True)
        with torch.enable_grad():
            if self.settings.loss_type == "kto":
                loss, metrics = self._kto(leaf, counts)
            else:
                loss, metrics = preference_loss(leaf, counts, self.ref, self.settings, self.totals)
            (grad,) = torch.autograd.grad(loss, leaf)
        self.metrics = {name: float(v) for name, v in metrics.items()}  # host tensors: no sync
        out, start = [], 0
        for m in self.masks:
            rows = grad[start : start + m.shape[0]].to(torch.float32)
            out.append({"dlogp": rows[:, None] * m})
            start += m.shape[0]
        return out, loss.detach().to(torch.float32)

    def _kto(
        self, leaf: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """KTO on rows 2k; rows 2k + 1 are their KL rows (prompt k, another row's completion):
        TRL's reference point kl = max(0, mean over the step's KL rows of logp - ref), detached
        (so the KL rows get no gradient); the step's rows are every rank's."""
        assert self.ref is not None and self.desirable is not None
        gaps = leaf[1::2].detach() - self.ref[1::2]  # host values
        weight = 1.0 if self.counted else 0.0
        total, rows = rank_sums([weight * float(gaps.sum()), weight * len(gaps)])  # sync point
        kl = torch.tensor(total / rows, dtype=torch.float64).clamp(min=0.0)
        loss, metrics = preference_loss(
            leaf[0::2],
            counts[0::2],
            self.ref[0::2],
            self.settings,
            self.totals,
            desirable=self.desirable,
            kl=float(kl),
        )
        return loss, {**metrics, "kl": kl}

    def __call__(self, logp_C: torch.Tensor, side: dict[str, torch.Tensor]) -> torch.Tensor:
        """The chunk's share: zero in value, gradient dlogp per token."""
        return (side["dlogp"] * (logp_C - logp_C.detach())).sum()
