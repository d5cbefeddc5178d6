"""The precomputed reference: one table of (chosen, rejected) log-prob sums per pair, equal to
the HF model's own (full logits, float64) within fp32's bound, found again by pair index for the
micro-batches of a shuffled epoch."""

from __future__ import annotations

import copy

import numpy as np
import torch

from megatrain.data.preference import PairSample
from megatrain.data.preference_data import PairLoader
from megatrain.data.sample import Sample
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.dpo.objective import sequence_logps, target_mask
from megatrain.recipes.dpo.reference import precompute_reference, reference_rows
from megatrain.verify import TOLERANCES, verify_config

NUM_PAIRS = 7


def _pairs(vocab: int) -> list[PairSample]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(NUM_PAIRS):
        prompt = torch.randint(3, vocab, (2 + i % 3,), generator=gen).tolist()
        rows = []
        for n in (1 + i, 4 + i % 2):
            ids = prompt + torch.randint(3, vocab, (n,), generator=gen).tolist()
            mask = [False] * len(prompt) + [True] * n
            rows.append(Sample(np.asarray(ids, np.int32), np.asarray(mask, np.bool_)))
        out.append(PairSample(rows[0], rows[1]))
    return out


def _hf_sums(model: torch.nn.Module, loader: PairLoader) -> torch.Tensor:
    """[NUM_PAIRS, 2] by the plain HF forward, float64, all pairs in one padded batch."""
    batch = loader.batch_of(np.arange(NUM_PAIRS))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])
    return (logp.squeeze(-1) * target_mask(batch)[:, 1:].double()).sum(-1).view(-1, 2)


def test_reference_table_matches_hf_and_is_found_by_pair() -> None:
    cfg = verify_config(model_type="qwen3", tiny=True)
    builder = RunBuilder(cfg)
    structure = builder.model()
    model = copy.deepcopy(structure.causal_lm).double()
    engine = builder.engine(structure, builder.store(structure))
    loader = PairLoader(
        _pairs(structure.causal_lm.config.vocab_size),
        micro_batch_size=2,
        seq_len=64,
        pad_token_id=0,
        pad_to_multiple_of=4,
        shuffle=True,
        seed=3,
    )
    try:
        table = precompute_reference(engine, loader, micro_batches_per_pass=3).table
        expected = _hf_sums(model, loader)
        rel = (table.double() - expected).abs().max() / expected.abs().max()
        assert rel <= TOLERANCES["fp32"]["loss"], float(rel)
        # a shuffled epoch's micro-batch finds its pairs' rows, chosen then rejected
        step = 1
        pairs = loader.pairs_of(0, step)
        batches = list(loader)
        assert not np.array_equal(pairs, [2, 3])  # shuffled
        assert torch.equal(batches[step].input_ids, loader.batch_of(pairs).input_ids)
        (own,) = sequence_logps(engine.logprobs([batches[step]]), [batches[step]])
        rows = reference_rows(table, pairs)
        assert torch.allclose(rows, own, rtol=TOLERANCES["fp32"]["loss"], atol=0.0)
    finally:
        engine.close()
