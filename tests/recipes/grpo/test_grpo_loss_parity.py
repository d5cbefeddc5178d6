"""The engine's GRPO step equals plain PyTorch: HF forward, log_softmax, TRL's formula.

fp32 engine against a float64 reference, per loss_type, beta 0 and > 0, one and two iterations
per generation batch (old log-probs from before the first update). The reference scores all
sequences in one padded batch and normalises exactly as TRL's GRPOTrainer writes it, so the
engine's per-token weights (recipes/grpo/loss.py) are checked against that formula, not against
themselves. Tolerance as in `megatrain verify`: per tensor, the relative error to float64 may be
the fp32 bound (megatrain.verify.TOLERANCES) or 10x the error plain PyTorch makes in fp32 on the
same step, whichever is larger (after an AdamW update, weights near a zero gradient carry
round-off of order lr into the next step in any fp32 implementation).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from megatrain.engine.head import TokenObjective
from megatrain.recipes.grpo.loss import GRPOLoss, token_weights
from megatrain.recipes.grpo.sequences import completion_mask, per_row, sequence_batches
from megatrain.verify import NOISE_FACTOR, TOLERANCES
from run_helpers import parity_engine, rel_error

TOL = TOLERANCES["fp32"]
MAX_COMPLETION = 9
EPS, EPS_HIGH, LR = 0.2, 0.28, 2e-3


def _sequences(vocab: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    gen = torch.Generator().manual_seed(3)
    prompts, completions = [], []
    for p_len, c_len in [(5, 9), (3, 4), (6, 7), (4, 1), (5, 9), (2, 6)]:
        prompts.append(torch.randint(3, vocab, (p_len,), generator=gen).tolist())
        completions.append(torch.randint(3, vocab, (c_len,), generator=gen).tolist())
    advantages = torch.randn(len(prompts), generator=gen).tolist()
    return prompts, completions, advantages


class _Reference:
    """TRL's GRPO loss on the whole generation batch at once, float64, torch AdamW."""

    def __init__(
        self, model: Any, batch: Any, advantages: list[float], beta: float, dtype: torch.dtype
    ) -> None:
        self.model = model.to(dtype)
        self.batch = batch
        self.adv = torch.tensor(advantages, dtype=dtype)[:, None]
        self.mask = completion_mask(batch)[:, 1:].to(dtype)
        self.beta = beta
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        with torch.no_grad():
            self.initial = self.logps()

    def logps(self) -> torch.Tensor:
        b = self.batch
        logits = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = b.input_ids[:, 1:].unsqueeze(-1)
        return logp.gather(-1, targets).squeeze(-1)

    @torch.no_grad()
    def entropy(self) -> float:
        """Mean entropy of the next-token distribution over the completion tokens."""
        b = self.batch
        logits = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        h = -(logp.exp() * logp).sum(-1)
        return float((h * self.mask).sum() / self.mask.sum())

    def step(self, loss_type: str, old: torch.Tensor | None) -> tuple[float, dict]:
        logp = self.logps()
        old = logp.detach() if old is None else old
        coef_1 = torch.exp(logp - old)
        coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS_HIGH)
        loss_t = -torch.min(coef_1 * self.adv, coef_2 * self.adv)
        if self.beta != 0.0:
            ref = self.initial
            loss_t = loss_t + self.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        m = self.mask
        if loss_type == "grpo":
            loss = ((loss_t * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
        elif loss_type == "dr_grpo":
            loss = (loss_t * m).sum() / (loss_t.size(0) * MAX_COMPLETION)
        else:
            loss = (loss_t * m).sum() / m.sum().clamp(min=1.0)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach()), grads


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_grpo_step_matches_pytorch(loss_type: str, beta: float, num_iterations: int) -> None:
    structure, reference_model, engine, landed = parity_engine(LR)
    vocab = structure.causal_lm.config.vocab_size
    prompts, completions, advantages = _sequences(vocab)
    micro = sequence_batches(prompts, completions, micro_batch_size=2, pad_token_id=0)
    whole = sequence_batches(prompts, completions, micro_batch_size=len(prompts), pad_token_id=0)
    ref = _Reference(copy.deepcopy(reference_model), whole[0], advantages, beta, torch.float64)
    ref32 = _Reference(reference_model, whole[0], advantages, beta, torch.float32)
    masks = [completion_mask(b) for b in micro]
    weights = token_weights(masks, loss_type=loss_type, max_completion_length=MAX_COMPLETION)
    adv = per_row(advantages, micro)
    inputs: list[dict[str, torch.Tensor]] = [
        {"advantages": a, "weights": w} for a, w in zip(adv, weights, strict=True)
    ]
    initial = engine.logprobs(micro)
    for k, logp in enumerate(initial):
        if num_iterations > 1:
            inputs[k]["old_logps"] = logp
        if beta > 0:
            inputs[k]["ref_logps"] = logp
    try:
        for it in range(num_iterations):
            fn = GRPOLoss(beta=beta, epsilon=EPS, epsilon_high=EPS_HIGH, use_old=num_iterations > 1)
            result = engine.train_step(micro, lr=LR, objective=TokenObjective(fn, inputs))
            engine.wait_updates()
            old = num_iterations > 1
            ref_entropy = ref.entropy()  # the weights this step's forward saw
            ref_loss, ref_grads = ref.step(loss_type, ref.initial if old else None)
            _, noise_grads = ref32.step(loss_type, ref32.initial if old else None)
            assert abs(result.loss - ref_loss) <= TOL["loss"] * abs(ref_loss), (it, result.loss)
            excess = {
                n: rel_error(landed[n], g)
                / max(TOL["grad"], NOISE_FACTOR * rel_error(noise_grads[n], g))
                for n, g in ref_grads.items()
            }
            worst = max(excess, key=excess.__getitem__)
            assert excess[worst] <= 1.0, (it, worst, excess[worst])
            assert fn.stats.tokens == sum(int(m.sum()) for m in masks)
            assert abs(fn.stats.entropy - ref_entropy) <= TOL["loss"] * ref_entropy
            if it == 1:  # the update moved the ratios: both clipped and unclipped tokens occur
                assert 0 < fn.stats.clipped_low + fn.stats.clipped_high < fn.stats.tokens
                assert (fn.stats.kl > 0) == (beta > 0)
    finally:
        engine.close()
