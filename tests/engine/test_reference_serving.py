"""Reference passes see the reference's weights in every block, the GPU tier's too.

GRPO's KL reference and DPO's `dpo.reference: weights` keep the initial weights in host RAM
(store/reference.py) and run a forward pass on them through the training engine
(`StreamingEngine.serving`). Blocks of a GPU tier never stream from the host store, so their
device weights are swapped as well, and put back after. Checked on the CPU (the tier's device
code path) after an optimizer step has moved every weight: the reference pass gives exactly
the log-probs of the initial model, and the policy's log-probs are unchanged by it. Before
`serving` swapped the tier, the tier's layers answered with the policy's weights.
"""

from __future__ import annotations

import pytest
import torch

from megatrain.batch import Batch
from megatrain.engine.engine import StreamingEngine
from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.plan import EnginePlan, tier_size
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.host import HostStore
from megatrain.store.reference import ReferenceWeights


def _engine(tier: int, dtype: torch.dtype) -> StreamingEngine:
    structure = discover(load_causal_lm(None, model_type="llama", tiny=True, seed=0))
    store = HostStore(structure, compute_dtype=dtype, pin_memory=False)
    vocab = structure.causal_lm.config.vocab_size
    plan = EnginePlan(
        num_slots=2,
        clip_norm=1.0,
        loss_chunk_tokens=default_chunk_tokens(vocab),
        gpu_state_blocks=min(tier, tier_size(len(store.layers))),
    )
    return StreamingEngine(structure, store, CpuAdamW(AdamWHyper()), plan, threaded_optimizer=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", [0, 2, 99])  # none, two layers, every block
def test_reference_pass_runs_the_initial_weights(tier: int, dtype: torch.dtype) -> None:
    engine = _engine(tier, dtype)
    reference = ReferenceWeights(engine.store)
    vocab = engine.structure.causal_lm.config.vocab_size
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    batches = [Batch(ids, ids.clone(), None)]
    initial = engine.logprobs(batches)
    for _ in range(2):  # a large step: every weight moves
        engine.train_step(batches, lr=5e-2)
    engine.wait_updates()
    policy = engine.logprobs(batches)
    assert not torch.equal(policy[0], initial[0])
    with engine.serving(reference):
        ref = engine.logprobs(batches)
    assert torch.equal(ref[0], initial[0])  # the same pass on the same weights: bit for bit
    assert torch.equal(engine.logprobs(batches)[0], policy[0])  # the policy is back
    engine.close()
