"""The pieces a DPO run chains, on the CPU: PairLoader micro-batches, the reference precomputed
once, PreferenceObjective steps through the engine. On 6 fixed pairs of a tiny model, sigmoid
DPO drives the loss from log 2 (policy = reference) down and every pair's implicit reward margin
positive: the sign conventions and the pair layout hold end to end."""

from __future__ import annotations

import math

import numpy as np
import torch

from megatrain.data.preference import PairSample
from megatrain.data.preference_data import PairLoader
from megatrain.data.sample import Sample
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.dpo.loss import LossSettings, StepTotals
from megatrain.recipes.dpo.objective import PreferenceObjective, target_mask
from megatrain.recipes.dpo.reference import precompute_reference, reference_rows
from megatrain.verify import verify_config

STEPS, LR = 6, 3e-3


def _sample(prompt: list[int], completion: list[int]) -> Sample:
    mask = [False] * len(prompt) + [True] * len(completion)
    return Sample(np.asarray(prompt + completion, np.int32), np.asarray(mask, np.bool_))


def test_sigmoid_dpo_learns_the_preferences() -> None:
    cfg = verify_config(model_type="llama", tiny=True, max_grad_norm=1.0, weight_decay=0.0, lr=LR)
    builder = RunBuilder(cfg)
    structure = builder.model()
    engine = builder.engine(structure, builder.store(structure))
    gen = torch.Generator().manual_seed(0)
    vocab = structure.causal_lm.config.vocab_size
    pairs = []
    for i in range(6):
        prompt = torch.randint(3, vocab, (3 + i % 2,), generator=gen).tolist()
        good, bad = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 2 + i % 3))
        pairs.append(PairSample(_sample(prompt, good), _sample(prompt, bad)))
    loader = PairLoader(
        pairs, micro_batch_size=2, seq_len=16, pad_token_id=0, pad_to_multiple_of=1,
        shuffle=True, seed=0,
    )  # fmt: skip
    settings = LossSettings("sigmoid", beta=0.5)
    try:
        table = precompute_reference(engine, loader, micro_batches_per_pass=3).table
        history = []
        for _ in range(STEPS):  # one epoch (3 micro-batches of 2 pairs) per step
            epoch = loader.epoch
            micro = list(loader)
            refs = [reference_rows(table, loader.pairs_of(epoch, s)) for s in range(len(micro))]
            chosen_tokens = int(sum(target_mask(b)[0::2].sum() for b in micro))
            totals = StepTotals(num_pairs=len(pairs), chosen_tokens=chosen_tokens)
            objective = PreferenceObjective(micro, settings, totals, ref_logps=refs)
            result = engine.train_step(micro, lr=LR, objective=objective.objective())
            engine.wait_updates()
            history.append((result.loss, objective.metrics["rewards/accuracies"] / len(pairs)))
    finally:
        engine.close()
    assert abs(history[0][0] - math.log(2)) < 1e-5  # the policy is its reference at step 1
    assert history[-1][0] < 0.1 * math.log(2), history
    assert history[-1][1] == 1.0, history
