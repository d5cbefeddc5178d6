"""The compact rollout (grpo.rollout_weights int8 / fp8): its decoder linear weights quantized from
the store, the rest kept; the sampled tokens' log-probs it records within a bound derived from
the weights' quantization error of the full-precision model's log-probs of the same tokens.

The bound, per completion token t: logp_t is a smooth function of the quantized weights W, so
to first order  logp_t(W - E) - logp_t(W) = -sum_ij g_ij E_ij  with g = d logp_t / dW, and by
Hoelder's inequality |sum g E| <= H_t = sum_ij |g_ij| e_ij, e_ij the format's element bound
(test_quant_linear.py: int8 s_i / 2; fp8 2^-4 |w_ij|, or s_i 2^-10 below 2^-6 s_i).

Two bounds, each with FLOAT32_SLACK for decoding with a KV cache against one forward over the
whole row, and an allowance for the second-order remainder of RELATIVE[fmt] x H_t (it scales
with the errors' square: their size relative to the weights, 2^-8 for int8's half step of 127,
2^-4 for fp8's half ulp, times the first-order term):
- worst case: |drift| <= H_t (any signs of the errors);
- typical: the rounding errors of random weights are independent and zero-mean within +-e_ij,
  so by Hoeffding's inequality P(|sum g E| >= 6 S_t) <= 2 exp(-18) (3e-8) with
  S_t^2 = sum_ij g_ij^2 e_ij^2: |drift| <= 6 S_t, some 100x tighter than H_t here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatrain.model.quant_linear import QuantLinear, compact_linears, quantize
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.decode import static_generate
from megatrain.recipes.grpo.rollout import device_model, generate
from megatrain.verify import verify_config

FLOAT32_SLACK = 1e-5  # nats: a few float32 roundings (2^-24 relative) per op, four tiny layers
RELATIVE = {"int8": 2.0**-8, "fp8": 2.0**-4}  # the element error's size relative to the weights
TEMPERATURE = 1.3
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _element_bound(w: torch.Tensor, fmt: str) -> torch.Tensor:
    _, s = quantize(w, fmt)
    if fmt == "int8":
        return (s / 2)[:, None].expand_as(w)
    normal = (w / s[:, None]).abs() >= 2.0**-6
    return torch.where(normal, 2.0**-4 * w.abs(), (s * 2.0**-10)[:, None].expand_as(w))


def _reference_and_bounds(
    model: nn.Module, prompt: list[int], completion: list[int], fmt: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full-precision model's log-probs of `completion` after `prompt` at TEMPERATURE, and
    each one's H_t and S_t (module docstring)."""
    layers = model.model.layers
    weights = [m.weight for m in compact_linears(layers).values()]
    bounds = [_element_bound(w.detach(), fmt) for w in weights]
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    worst, spread = [], []
    for t in range(len(completion)):
        grads = torch.autograd.grad(logp[t], weights, retain_graph=True)
        worst.append(sum(float((g.abs() * e).sum()) for g, e in zip(grads, bounds, strict=True)))
        squares = sum(float((g * e).square().sum()) for g, e in zip(grads, bounds, strict=True))
        spread.append(squares**0.5)
    return logp.detach(), torch.tensor(worst), torch.tensor(spread)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_compact_rollout_logprobs_are_within_the_quantization_bound(fmt: str) -> None:
    builder = RunBuilder(verify_config(model_type="qwen2", tiny=True))
    reference = builder.model().causal_lm.eval()  # same seed: the store's weights
    structure = builder.model()
    store = builder.store(structure)
    assert store.compute_dtype == torch.float32  # the drift is the quantization's alone
    sampling = dict(max_new_tokens=6, pad_token_id=0, eos_token_ids=[3], do_sample=True)
    with device_model(structure, store, builder.device, compact=fmt) as model:
        linears = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == len(compact_linears(reference.model.layers))
        assert model.lm_head.weight.dtype == torch.float32  # head and embedding kept
        ours = generate(model, PROMPTS, **sampling, temperature=TEMPERATURE, seed=3, logprobs=True)
        static = static_generate(
            model, PROMPTS, **sampling, temperature=TEMPERATURE, seed=3, logprobs=True
        )
    assert static.completions == ours.completions and ours.logps is not None
    assert static.logps is not None  # the static path records the same log-probs
    assert torch.tensor(static.logps) == pytest.approx(torch.tensor(ours.logps), abs=FLOAT32_SLACK)
    drift = []
    for prompt, completion, logps in zip(PROMPTS, ours.completions, ours.logps, strict=True):
        expected, worst, spread = _reference_and_bounds(reference, prompt, completion, fmt)
        error = (torch.tensor(logps) - expected).abs()
        slack = RELATIVE[fmt] * worst + FLOAT32_SLACK
        assert bool((error <= worst + slack).all()), (error, worst)
        assert bool((error <= 6 * spread + slack).all()), (error, spread)
        drift.append(float(error.max()))
    assert max(drift) > 10 * FLOAT32_SLACK  # the weights were quantized: the log-probs moved


def test_full_precision_rollout_logprobs_are_the_models() -> None:
    """Without compact weights the recorded log-probs are the model's own, to float32
    rounding: what the importance ratio compares against is the precision alone."""
    builder = RunBuilder(verify_config(model_type="qwen2", tiny=True))
    reference = builder.model().causal_lm.eval()
    structure = builder.model()
    store = builder.store(structure)
    with device_model(structure, store, builder.device) as model:
        ours = generate(
            model,
            PROMPTS,
            max_new_tokens=6,
            pad_token_id=0,
            eos_token_ids=[3],
            do_sample=True,
            temperature=TEMPERATURE,
            seed=3,
            logprobs=True,
        )
    assert ours.logps is not None
    for prompt, completion, logps in zip(PROMPTS, ours.completions, ours.logps, strict=True):
        assert len(logps) == len(completion)
        expected, _, _ = _reference_and_bounds(reference, prompt, completion, "int8")
        assert torch.tensor(logps) == pytest.approx(expected, abs=FLOAT32_SLACK)
