"""GRPO's log-prob passes: batched as training is, and skipped where the old policy is current.

- The engine's forward-only pass (StreamingEngine.logprobs) over micro-batches of several rows
  gives each completion token's log-prob as one row at a time does, within fp32's bound: both
  are compared with the HF model in float64 on the unpadded row, each within the fp32 bound of
  `megatrain verify` (TOLERANCES: relative 1e-5), so they differ by at most twice that (the
  triangle inequality). Only rounding differs: a padded row attends to nothing past its end
  (the mask), but its matrix products run at another shape, whose sums the CPU may order
  differently.
- Rows grouped by length (`length_order`) pad less and change the step only by rounding.
- With grpo.num_iterations 1 the recipe runs no old-policy pass: old_logp = logp.detach(). A
  step that computes the pass instead (the same weights, the same micro-batches) gets the same
  log-probs bit for bit: the pass and the step's forward run the same kernels on the same
  tensors, and the head takes the same chunks of the same supervised rows (engine/head.py), so
  the ratio is exactly 1 either way and the loss and every gradient are identical.
"""

from __future__ import annotations

import copy

import torch

from megatrain.engine.head import TokenObjective
from megatrain.recipes.grpo.loss import GRPOLoss, token_weights
from megatrain.recipes.grpo.sequences import (
    completion_mask,
    length_order,
    per_row,
    sequence_batches,
)
from megatrain.verify import TOLERANCES
from run_helpers import parity_engine, rel_error

TOL = TOLERANCES["fp32"]["loss"]
LR = 2e-3


def _sequences(vocab: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    gen = torch.Generator().manual_seed(5)
    prompts, completions = [], []
    for p_len, c_len in [(5, 9), (3, 4), (6, 7), (4, 1), (5, 9), (2, 6)]:
        prompts.append(torch.randint(3, vocab, (p_len,), generator=gen).tolist())
        completions.append(torch.randint(3, vocab, (c_len,), generator=gen).tolist())
    return prompts, completions, torch.randn(len(prompts), generator=gen).tolist()


def _completion_logps(logps: list[torch.Tensor], batches: list) -> list[torch.Tensor]:
    """Each row's completion-token log-probs, in row order (padding dropped)."""
    return [
        row[mask.bool()]
        for logp, b in zip(logps, batches, strict=True)
        for row, mask in zip(logp, completion_mask(b), strict=True)
    ]


def test_batched_logprob_pass_equals_one_row_at_a_time_within_fp32() -> None:
    structure, model, engine, _ = parity_engine(LR)
    prompts, completions, _ = _sequences(structure.causal_lm.config.vocab_size)
    batched = sequence_batches(prompts, completions, micro_batch_size=3, pad_token_id=0)
    single = sequence_batches(prompts, completions, micro_batch_size=1, pad_token_id=0)
    assert [b.input_ids.shape for b in batched] == [(3, 14), (3, 14)]  # rows padded
    rows_b = _completion_logps(engine.logprobs(batched), batched)
    rows_s = _completion_logps(engine.logprobs(single), single)
    engine.close()
    exact = copy.deepcopy(model).double()
    for p, c, b, s in zip(prompts, completions, rows_b, rows_s, strict=True):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logp = torch.log_softmax(exact(input_ids=ids).logits[0, :-1], -1)
        want = logp.gather(-1, ids[0, 1:, None])[len(p) - 1 :, 0]
        assert rel_error(b, want) <= TOL and rel_error(s, want) <= TOL
        assert rel_error(b, s.double()) <= 2 * TOL


def _step(old_pass: bool, order: list[int] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """One GRPO step (beta 0, num_iterations 1) on a fresh engine; `old_pass`: the old
    log-probs from a pass before it, as num_iterations > 1 computes them; `order`: the rows'
    (None: as they come)."""
    structure, _, engine, landed = parity_engine(LR)
    prompts, completions, advantages = _sequences(structure.causal_lm.config.vocab_size)
    if order is not None:
        prompts, completions = [prompts[i] for i in order], [completions[i] for i in order]
        advantages = [advantages[i] for i in order]
    micro = sequence_batches(prompts, completions, micro_batch_size=2, pad_token_id=0)
    weights = token_weights(
        [completion_mask(b) for b in micro], loss_type="dapo", max_completion_length=9
    )
    inputs = [
        {"advantages": a, "weights": w}
        for a, w in zip(per_row(advantages, micro), weights, strict=True)
    ]
    if old_pass:
        for k, logp in enumerate(engine.logprobs(micro)):
            inputs[k]["old_logps"] = logp
    fn = GRPOLoss(beta=0.0, epsilon=0.2, epsilon_high=0.28, use_old=old_pass)
    result = engine.train_step(micro, lr=LR, objective=TokenObjective(fn, inputs))
    engine.wait_updates()
    engine.close()
    return result.loss, landed


def test_skipped_old_policy_pass_gives_the_same_step_bit_for_bit() -> None:
    loss_skipped, grads_skipped = _step(old_pass=False)
    loss_computed, grads_computed = _step(old_pass=True)
    assert loss_skipped == loss_computed
    assert grads_skipped.keys() == grads_computed.keys() and grads_skipped
    for name, g in grads_skipped.items():
        assert torch.equal(g, grads_computed[name]), name


def test_length_order_groups_rows_and_changes_the_step_only_by_rounding() -> None:
    """Longest first where there are several micro-batches: micro-batches of 2 rows of the six
    sequences (rows of 14, 7, 13, 5, 14, 8 tokens) pad to 14 + 13 + 14 = 41 columns given as
    they come, 14 + 13 + 7 = 34 grouped. The step's loss is a sum over rows, so the order
    changes only its rounding: both orders are within the fp32 bound of float64 for any
    micro-batching (test_grpo_loss_parity.py), so within twice that of each other."""
    _, _, engine, _ = parity_engine(LR)
    vocab = engine.structure.causal_lm.config.vocab_size
    engine.close()
    prompts, completions, _ = _sequences(vocab)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    order = length_order(lengths, 2)
    assert order == [0, 4, 2, 5, 1, 3]
    assert length_order(lengths, 6) == list(range(6))  # one micro-batch: nothing to group
    given = sequence_batches(prompts, completions, micro_batch_size=2, pad_token_id=0)
    grouped = sequence_batches(
        [prompts[i] for i in order], [completions[i] for i in order], micro_batch_size=2,
        pad_token_id=0,
    )  # fmt: skip
    assert [b.input_ids.shape[1] for b in given] == [14, 13, 14]
    assert [b.input_ids.shape[1] for b in grouped] == [14, 13, 7]
    loss_given = _step(False, order=None)[0]
    loss_grouped = _step(False, order=order)[0]
    assert abs(loss_grouped - loss_given) <= 2 * TOL * abs(loss_given)
