"""Static decoding on CUDA (skipped without a GPU): the step captured as a CUDA graph, with the
eager kernels and with the compiled forward, decodes the same greedy tokens as transformers'
`generate` on the same device copy of the model, for a dense model (llama) and a hybrid one
(qwen3_5_text: linear-attention layers, whose convolution and recurrent states the graph updates
in place), with whatever kernels are installed (flash-linear-attention's where it is). fp32
weights: the two paths' roundings differ by a few float32 ulps, far below a greedy choice's
margin on these random models."""

from __future__ import annotations

import pytest
import torch

from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.decode import static_generate
from megatrain.recipes.grpo.rollout import device_model, generate
from megatrain.verify import verify_config

pytestmark = pytest.mark.gpu

NEW = 24  # past one stop check, enough steps for a graph


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_graphed_static_decoding_equals_generate(model_type: str, compiled: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = verify_config(None, ["--training.device", "cuda"], model_type=model_type, tiny=True)
    builder = RunBuilder(cfg)
    structure = builder.model()
    store = builder.store(structure)
    gen = torch.Generator().manual_seed(0)
    vocab = structure.causal_lm.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]
    kw = {"max_new_tokens": NEW, "pad_token_id": 0, "eos_token_ids": [1], "do_sample": False}
    with device_model(structure, store, builder.device) as model:
        assert next(model.parameters()).is_cuda
        eager = generate(model, prompts, **kw)
        graphed = static_generate(model, prompts, compile_forward=compiled, cuda_graph=True, **kw)
    assert graphed.decode_steps > 0  # replayed (token 0 prefilled, token 1 warmed it up)
    assert graphed.completions == eager.completions
