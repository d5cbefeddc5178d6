"""Random init on a device (model/random_init.py) is HF's own init scheme, module by module."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.initialization import no_init_weights

from megatrain.model.loading import load_causal_lm
from megatrain.model.random_init import init_on_device
from megatrain.model.tiny import TESTED_MODEL_TYPES, tiny_config


def _allocated(model_type: str) -> torch.nn.Module:
    with no_init_weights():
        return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)


@pytest.mark.parametrize("model_type", TESTED_MODEL_TYPES)
def test_visit_order_and_values_equal_hf_initialize_weights(model_type: str) -> None:
    """On the CPU the visit is HF's: same modules, same order, so the same random numbers."""
    hf, ours = _allocated(model_type), _allocated(model_type)
    torch.manual_seed(3)
    hf.init_weights()
    torch.manual_seed(3)
    init_on_device(ours, torch.device("cpu"))
    want = {**hf.state_dict(), **dict(hf.named_buffers())}
    got = {**ours.state_dict(), **dict(ours.named_buffers())}
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    if hf.config.tie_word_embeddings:
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_text", "gemma3_text"])
def test_cuda_init_equals_hf_init_on_cuda(model_type: str) -> None:
    """On the GPU the module-by-module visit draws the same numbers as HF's `init_weights` run on
    a model held on the GPU (the same calls in the same order on the CUDA generator), and leaves
    the model on the CPU. (A comparison of sample statistics against the CPU init cannot be
    exact: some tensors are tiny and not normal, e.g. linear attention's 4-element A_log.)"""
    cuda = torch.device("cuda")
    hf, ours = _allocated(model_type).to(cuda), _allocated(model_type)
    torch.manual_seed(5)
    hf.init_weights()
    torch.manual_seed(5)
    init_on_device(ours, cuda)
    want = {**hf.state_dict(), **dict(hf.named_buffers())}
    got = {**ours.state_dict(), **dict(ours.named_buffers())}
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].device.type == "cpu", name
        assert torch.equal(tensor.cpu(), got[name]), name


@pytest.mark.gpu
def test_load_with_cuda_init_returns_the_model_on_the_cpu() -> None:
    model = load_causal_lm(
        None, model_type="llama", tiny=True, seed=5, init_device=torch.device("cuda")
    )
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}
