"""The torch.compile'd decoding forward (recipes/grpo/decode.py `compiled_forward`, inductor on the
CPU): greedy tokens equal the eager static path and transformers' `generate`, and a second
generation batch (a fresh device copy of the model, new weight tensors) runs the compiled code
without compiling again: the compile is paid once per run."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.decode import static_generate
from megatrain.recipes.grpo.rollout import device_model, generate
from megatrain.verify import verify_config

NEW = 10


def test_compiled_forward_compiles_once_and_decodes_the_same_tokens() -> None:
    builder = RunBuilder(verify_config(model_type="qwen2", tiny=True))
    structure = builder.model()
    store = builder.store(structure)
    gen = torch.Generator().manual_seed(0)
    vocab = structure.causal_lm.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 4, 9)]
    kw = {"max_new_tokens": NEW, "pad_token_id": 0, "eos_token_ids": [1], "do_sample": False}
    with device_model(structure, store, builder.device) as model:
        reference = generate(model, prompts, **kw).completions
        eager = static_generate(model, prompts, cache_len=20, **kw).completions
        compiled = static_generate(model, prompts, cache_len=20, compile_forward=True, **kw)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and compiled.completions == eager == reference
    sampled = []
    for _ in range(2):  # two more batches, each a fresh device copy of the weights
        with device_model(structure, store, builder.device) as model:
            rollout = static_generate(
                model,
                prompts,
                cache_len=20,
                compile_forward=True,
                seed=3,
                **kw | {"do_sample": True},
            )
            sampled.append(rollout.completions)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    assert sampled[0] == sampled[1]
