"""A preference step through the StreamingEngine equals plain PyTorch: HF forward with full
logits, log_softmax, TRL's formulas written out here, torch AdamW.

Per loss type: fp32 engine (CPU, two micro-batches of two pairs, rows 2k / 2k + 1 chosen /
rejected) against a float64 reference on the whole batch at once, two optimizer steps (the
reference log-probs stay those of the initial weights, precomputed with `engine.logprobs`).
Checked: the loss, TRL's metrics, and every parameter's gradient. KTO: rows 2k are labelled
rows, rows 2k + 1 their KL rows; its reference is shifted below the initial weights so that the
reference point (TRL's kl) is positive. Tolerance as in `megatrain
verify` and the GRPO parity test: per tensor, the relative error to float64 may be the fp32 bound
(megatrain.verify.TOLERANCES) or NOISE_FACTOR x the error plain PyTorch makes in fp32 on the same
step, whichever is larger.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from megatrain.recipes.dpo.loss import LossSettings, StepTotals
from megatrain.recipes.dpo.objective import PreferenceObjective, sequence_logps, target_mask
from megatrain.recipes.grpo.sequences import sequence_batches
from megatrain.verify import NOISE_FACTOR, TOLERANCES
from run_helpers import parity_engine, rel_error

TOL = TOLERANCES["fp32"]
LR = 2e-3
DESIRABLE = [True, False, True, True]  # KTO: rows 2k (rows 2k + 1 are their KL rows)
# KTO: a reference below the initial weights by these (per row), so the reference point
# kl = max(0, mean(logp - ref) over the KL rows) is positive from the first step
KTO_REF_OFFSET = torch.tensor([0.0, 0.3, 0.1, 0.5, 0.0, 0.2, 0.4, 0.1])
SETTINGS = {
    "sigmoid": LossSettings("sigmoid", beta=0.5, label_smoothing=0.1, rpo_alpha=0.3),
    "robust": LossSettings("robust", beta=0.5, label_smoothing=0.2),
    "hinge": LossSettings("hinge", beta=2.0),
    "ipo": LossSettings("ipo", beta=0.3),
    "orpo": LossSettings("orpo", beta=0.4),
    "simpo": LossSettings("simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=0.05),
    "kto": LossSettings("kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.8),
}


def _rows(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """4 pairs: one prompt, two completions of different lengths each."""
    gen = torch.Generator().manual_seed(5)
    prompts, completions = [], []
    for p_len, c_len, r_len in [(5, 7, 3), (3, 2, 6), (6, 5, 5), (2, 8, 1)]:
        prompt = torch.randint(3, vocab, (p_len,), generator=gen).tolist()
        for n in (c_len, r_len):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
    return prompts, completions


class _Reference:
    """TRL's formulas on the whole batch, HF forward with full logits, torch AdamW."""

    def __init__(self, model: Any, batch: Any, s: LossSettings, dtype: torch.dtype) -> None:
        self.model, self.batch, self.s = model.to(dtype), batch, s
        self.mask = target_mask(batch)[:, 1:].to(dtype)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        with torch.no_grad():
            self.ref = self.logps()
        if s.loss_type == "kto":
            self.ref = self.ref - KTO_REF_OFFSET.to(dtype)

    def logps(self) -> torch.Tensor:
        b = self.batch
        logits = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        per_token = logp.gather(-1, b.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return (per_token * self.mask).sum(-1)

    def loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        s, counts = self.s, self.mask.sum(-1)
        pol, ref = self.logps(), self.ref
        nll = -pol[0::2].sum() / counts[0::2].sum()  # cross-entropy mean over chosen tokens
        if s.loss_type in ("ipo", "orpo", "simpo"):  # TRL averages these over the completion
            pol, ref = pol / counts, ref / counts
        if s.loss_type == "kto":  # TRL KTOTrainer.kto_loss; rows 2k + 1: the KL rows
            kl = (pol[1::2] - ref[1::2]).mean().clamp(min=0).detach()
            good = torch.tensor(DESIRABLE)
            ratio, lp = pol[0::2] - ref[0::2], pol[0::2].detach()
            chosen = 1 - torch.sigmoid(s.beta * (ratio[good] - kl))
            rejected = 1 - torch.sigmoid(s.beta * (kl - ratio[~good]))
            losses = torch.cat([s.desirable_weight * chosen, s.undesirable_weight * rejected])
            r = (s.beta * ratio).detach()
            metrics = {"rewards/chosen": r[good].sum(), "rewards/rejected": r[~good].sum()}
            metrics.update({"logps/chosen": lp[good].sum(), "logps/rejected": lp[~good].sum()})
            return losses.mean(), {**metrics, "kl": kl}
        c, r = pol[0::2], pol[1::2]
        free = s.loss_type in ("orpo", "simpo")
        logits = (c - r) - (0 if free else ref[0::2] - ref[1::2])
        ls, beta = s.label_smoothing, s.beta
        if s.loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        elif s.loss_type == "robust":
            robust = -F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls
            losses = robust / (1 - 2 * ls)
        elif s.loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        elif s.loss_type == "ipo":
            losses = (logits - 1 / (2 * beta)) ** 2
        elif s.loss_type == "simpo":
            logits = logits - s.simpo_gamma / beta
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        else:  # orpo: TRL ORPOTrainer.odds_ratio_loss, loss = nll - mean(beta * log s(.))
            log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
            losses = -beta * F.logsigmoid(log_odds)
        loss = losses.mean() + (1.0 if s.loss_type == "orpo" else s.rpo_alpha) * nll
        cr = (beta * (c if free else c - ref[0::2])).detach()
        rr = (beta * (r if free else r - ref[1::2])).detach()
        metrics = {
            "rewards/chosen": cr.sum(),
            "rewards/rejected": rr.sum(),
            "rewards/accuracies": (cr > rr).double().sum(),
            "rewards/margins": (cr - rr).sum(),
            "logps/chosen": c.detach().sum(),
            "logps/rejected": r.detach().sum(),
        }
        return loss, metrics

    def step(self) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
        loss, metrics = self.loss()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, grads


@pytest.mark.parametrize("loss_type", list(SETTINGS))
def test_preference_step_matches_pytorch(loss_type: str) -> None:
    settings = SETTINGS[loss_type]
    structure, reference_model, engine, landed = parity_engine(LR)
    prompts, completions = _rows(structure.causal_lm.config.vocab_size)
    micro = sequence_batches(prompts, completions, micro_batch_size=4, pad_token_id=0)
    whole = sequence_batches(prompts, completions, micro_batch_size=8, pad_token_id=0)[0]
    ref = _Reference(copy.deepcopy(reference_model), whole, settings, torch.float64)
    ref32 = _Reference(reference_model, whole, settings, torch.float32)
    kto = loss_type == "kto"
    counts = [target_mask(b).sum(-1) for b in micro]
    totals = StepTotals(
        num_pairs=len(prompts) // 2,  # pairs, or KTO rows (with their KL rows)
        chosen_tokens=int(sum(c[0::2].sum() for c in counts)),
    )
    free = loss_type in ("orpo", "simpo")
    ref_logps = None if free else sequence_logps(engine.logprobs(micro), micro)
    if kto:
        assert ref_logps is not None
        ref_logps = [r - o for r, o in zip(ref_logps, KTO_REF_OFFSET.split(4), strict=True)]
    desirable = [torch.tensor(DESIRABLE[:2]), torch.tensor(DESIRABLE[2:])] if kto else None
    try:
        for step in range(2):
            objective = PreferenceObjective(
                micro, settings, totals, ref_logps=ref_logps, desirable=desirable
            )
            result = engine.train_step(micro, lr=LR, objective=objective.objective())
            engine.wait_updates()
            ref_loss, ref_metrics, ref_grads = ref.step()
            _, _, noise_grads = ref32.step()
            assert abs(result.loss - ref_loss) <= TOL["loss"] * abs(ref_loss), (step, result.loss)
            assert set(objective.metrics) == set(ref_metrics)
            if kto:
                assert ref_metrics["kl"] > 0.05  # the reference point is exercised
            for name, value in ref_metrics.items():  # sums over 4 pairs: an absolute bound
                assert abs(objective.metrics[name] - value) <= TOL["loss"] * max(abs(value), 1.0)
            excess = {
                n: rel_error(landed[n], g)
                / max(TOL["grad"], NOISE_FACTOR * rel_error(noise_grads[n], g))
                for n, g in ref_grads.items()
            }
            worst = max(excess, key=excess.__getitem__)
            assert excess[worst] <= 1.0, (step, worst, excess[worst])
    finally:
        engine.close()
