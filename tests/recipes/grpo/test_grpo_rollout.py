"""Rollouts: greedy generation from the store's weights (resident, or layers streamed) equals
transformers' `generate` on the same weights; sampling is reproducible from its seed;
completions end at the first EOS."""

from __future__ import annotations

import pytest
import torch

from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.rollout import device_model, generate
from megatrain.verify import verify_config


@pytest.mark.parametrize(("model_type", "tied"), [("qwen3", True), ("llama", False)])
def test_greedy_rollout_equals_transformers_generate(model_type: str, tied: bool) -> None:
    cfg = verify_config(
        model_type=model_type, tiny=True, config_overrides={"tie_word_embeddings": tied}
    )
    builder = RunBuilder(cfg)
    reference = builder.model().causal_lm.eval()  # same seed: the same initial weights
    structure = builder.model()
    store = builder.store(structure)
    gen = torch.Generator().manual_seed(0)
    vocab = reference.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 8, 3)]
    eos = [7]
    with device_model(structure, store, builder.device) as model:
        ours = generate(
            model, prompts, max_new_tokens=12, pad_token_id=0, eos_token_ids=eos, do_sample=False
        )
        sampled = [
            generate(
                model,
                prompts,
                max_new_tokens=12,
                pad_token_id=0,
                eos_token_ids=eos,
                do_sample=True,
                temperature=1.5,
                seed=s,
            ).completions
            for s in (1, 1, 2)
        ]
    assert sampled[0] == sampled[1] != sampled[2]
    for num_slots in (1, 2):  # layers streamed into slots by forward pre-hooks: same tokens
        with device_model(
            structure, store, builder.device, streamed=True, num_slots=num_slots
        ) as model:
            streamed = generate(
                model,
                prompts,
                max_new_tokens=12,
                pad_token_id=0,
                eos_token_ids=eos,
                do_sample=False,
            )
        assert streamed.completions == ours.completions
    width = max(len(p) for p in prompts)
    for prompt, completion, clipped in zip(prompts, ours.completions, ours.clipped, strict=True):
        ids = torch.tensor([prompt])  # one prompt alone: no padding at all in the reference
        out = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
        expected = out[0, len(prompt) :].tolist()
        assert completion == expected[: len(completion)] and width >= len(prompt)
        assert clipped == (7 not in expected) and len(completion) == (
            12 if clipped else expected.index(7) + 1
        )
