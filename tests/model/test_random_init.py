"""Random init on a device (model/random_init.py) is HF's own init scheme, module by module."""

from __future__ import annotations

import math

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
def test_cuda_init_follows_the_scheme_and_returns_to_the_cpu(model_type: str) -> None:
    """Different random numbers than the CPU, same scheme: constants equal, random tensors with
    the configured std: the two sample stds differ by less than 6 standard errors of their
    difference (sqrt(2) x std / sqrt(2(n-1)) for normal samples); computed buffers (rotary
    frequencies) equal to a few ulp of fp32 (each device's own pow and division)."""
    cpu = load_causal_lm(None, model_type=model_type, tiny=True, seed=5)
    gpu = load_causal_lm(
        None, model_type=model_type, tiny=True, seed=5, init_device=torch.device("cuda")
    )
    for name, w in cpu.named_buffers():
        g = dict(gpu.named_buffers())[name]
        assert g.device.type == "cpu", name
        torch.testing.assert_close(g, w, rtol=4 * torch.finfo(w.dtype).eps, atol=0)
    want, got = dict(cpu.named_parameters()), dict(gpu.named_parameters())
    assert want.keys() == got.keys()
    for name, w in want.items():
        g = got[name]
        assert g.device.type == "cpu" and g.dtype == w.dtype and g.shape == w.shape, name
        if w.numel() < 2 or w.std() == 0:  # constants: norm ones, zero biases
            assert torch.equal(w, g), name
            continue
        bound = 6 * math.sqrt(2) * w.std().item() / math.sqrt(2 * (w.numel() - 1))
        assert abs(g.std().item() - w.std().item()) <= bound, name
    if cpu.config.tie_word_embeddings:
        assert gpu.get_output_embeddings().weight is gpu.get_input_embeddings().weight
