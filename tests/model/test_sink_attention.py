"""Attention sinks on sdpa (model/sink_attention.py) equal transformers' eager GPT-OSS attention.

The attention function against `eager_attention_forward` of a tiny GPT-OSS attention module:
outputs and the gradients of query, key, value and sinks, for causal, sliding-window, padded
(rows with no visible key included) and absent masks, grouped-query heads, head dims that are
and are not multiples of 8 (an absent mask on a square causal call: the sink as key 0 of a causal
call, no mask). Then the whole tiny model as the loader builds it: sinks on sdpa by default,
loss and gradients equal to the same model run eager, on padded, packed and full rows.

Tolerances are fp32 rounding bounds, not fitted: a result computed through a chain of n roundings
is within n x eps of the exact value in units of its largest entry (Higham's bound for an n-term
sum), so two fp32 evaluations of one function are within twice that of each other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

from megatrain.choices import SINK_ATTENTION
from megatrain.model.loading import load_causal_lm
from megatrain.model.tiny import tiny_config
from megatrain.verify import TOLERANCES
from megatrain.verify.judge import rel_errors

EPS = torch.finfo(torch.float32).eps
ROWS, SEQ, WINDOW = 2, 24, 8
HEADS, KV_HEADS = 4, 2
SINKS = ALL_ATTENTION_FUNCTIONS[SINK_ATTENTION]


def _module() -> GptOssAttention:
    torch.manual_seed(0)
    module = GptOssAttention(tiny_config("gpt_oss"), 0)
    assert (module.config.num_attention_heads, module.config.num_key_value_heads) == (4, 2)
    nn.init.normal_(module.sinks)  # unit sinks: as large as the scores, so they matter
    return module


def _mask(kind: str) -> torch.Tensor | None:
    """Bool [B, 1, S, S] (True: attend), as transformers builds it for sdpa."""
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    causal = (j <= i).expand(ROWS, 1, SEQ, SEQ)
    if kind == "none":
        return None
    if kind == "sliding":
        return causal & (i - j < WINDOW)
    if kind == "padded":
        keys = torch.ones(ROWS, SEQ, dtype=torch.bool)
        keys[0, -5:] = False  # right padding (the padded layout)
        keys[1, :3] = False  # left padding: the first three queries see no key at all
        return causal & keys[:, None, None, :]
    return causal


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """The eager form of a bool mask, as transformers' eager mask function writes it."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _inputs(head_dim: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    q = torch.randn(ROWS, HEADS, SEQ, head_dim, requires_grad=True)
    k = torch.randn(ROWS, KV_HEADS, SEQ, head_dim, requires_grad=True)
    v = torch.randn(ROWS, KV_HEADS, SEQ, head_dim, requires_grad=True)
    return q, k, v


def _assert_fp32_close(ours: torch.Tensor, ref: torch.Tensor, roundings: int) -> None:
    error, bound = (ours - ref).abs().max(), 2 * roundings * EPS * ref.abs().max()
    assert error <= bound, f"{float(error / EPS):.1f} eps, bound {float(bound / EPS):.1f}"


@pytest.mark.parametrize("head_dim", [7, 12, 16, 64])  # + 1 sink feature: 8, 16, 24, 72 wide
@pytest.mark.parametrize("kind", ["causal", "sliding", "padded", "none"])
def test_equals_eager_outputs_and_gradients(kind: str, head_dim: int) -> None:
    module, (q, k, v) = _module(), _inputs(head_dim)
    mask = _mask(kind)
    eager_mask = _additive(_mask("causal") if mask is None else mask)  # None: causal
    ref, _ = eager_attention_forward(module, q, k, v, eager_mask, scaling=module.scaling)
    out, weights = SINKS(module, q, k, v, mask, scaling=module.scaling, s_aux=module.sinks)
    assert weights is None and out.shape == ref.shape == (ROWS, SEQ, HEADS, head_dim)
    width = -(-(head_dim + 1) // 8) * 8
    forward = width + 2 * (SEQ + 1)  # the scores' dot, the softmax's sum, the values' sum
    _assert_fp32_close(out, ref, forward)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    inputs = (q, k, v, module.sinks)
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    grads = torch.autograd.grad(out, inputs, grad)
    # + grad . v, the softmax backward's row sum, and the longest sum over queries: a sink's
    # over every row and position, a key's over its group's heads (repeat_kv's backward)
    backward = forward + head_dim + SEQ + 1 + ROWS * SEQ * HEADS // KV_HEADS
    for name, ours, theirs in zip("qkv", grads, ref_grads, strict=False):
        assert ours.shape == theirs.shape, name
    for ours, theirs in zip(grads, ref_grads, strict=True):
        _assert_fp32_close(ours, theirs, backward)
    if kind == "padded":  # a query that sees no key attends to the sink alone: output 0
        assert torch.equal(out[1, :3], torch.zeros_like(out[1, :3]))


def test_an_additive_mask_and_no_causality() -> None:
    """The eager form of a mask (float, added to the scores) works as the bool one; without a
    mask and not causal, every key is seen."""
    module, (q, k, v) = _module(), _inputs(12)
    forward = 16 + 2 * (SEQ + 1)
    for mask in (_additive(_mask("sliding")), None):
        ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)
        out, _ = SINKS(
            module, q, k, v, mask, scaling=module.scaling, is_causal=False, s_aux=module.sinks
        )
        _assert_fp32_close(out, ref, forward)


def test_without_sinks_it_is_transformers_sdpa() -> None:
    module, (q, k, v) = _module(), _inputs(16)
    for mask in (_mask("padded"), None):
        ours, _ = SINKS(module, q, k, v, mask, scaling=module.scaling, sliding_window=None)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)
        assert torch.equal(ours, ref)


def test_dropout_is_refused() -> None:
    module, (q, k, v) = _module(), _inputs(16)
    with pytest.raises(ValueError, match=r"attention_dropout: 0\.0"):
        SINKS(module, q, k, v, None, scaling=module.scaling, dropout=0.1, s_aux=module.sinks)


class _CountSdpa(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.causal = 0  # of which square, causal and without a mask (the flash kernel's)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            q, k = args[0], args[1]
            plain = kwargs.get("attn_mask") is None and kwargs.get("is_causal", False)
            self.causal += plain and q.shape[-2] == k.shape[-2]
        return func(*args, **kwargs)


def test_full_rows_run_causal_without_a_mask() -> None:
    """No mask and causal (what transformers passes a full-attention layer on unpadded rows):
    one square causal call with the sink as key 0; a mask keeps the masked call."""
    module, (q, k, v) = _module(), _inputs(64)
    for mask, causal in ((None, 1), (_mask("causal"), 0)):
        with _CountSdpa() as count:
            SINKS(module, q, k, v, mask, scaling=module.scaling, s_aux=module.sinks)
        assert (count.calls, count.causal) == (1, causal)


def _loss_and_grads(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor], _CountSdpa]:
    model.zero_grad(set_to_none=True)
    with _CountSdpa() as count:
        loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, count


def _batches() -> dict[str, dict[str, torch.Tensor]]:
    ids = torch.randint(3, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, -8:] = 0
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    positions = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(ROWS, -1)
    packed = {"input_ids": ids, "position_ids": positions, "labels": ids}
    full = {"input_ids": ids, "labels": ids}
    return {"padded": padded, "packed": packed, "full": full}


@pytest.mark.parametrize("layout", ["padded", "packed", "full"])
def test_the_loaded_model_runs_sinks_on_sdpa_as_eager_computes(layout: str) -> None:
    """The loader's default for GPT-OSS (no attn_implementation asked for); the same weights
    loaded eager give the same loss and gradients (verify's fp32 tolerances)."""
    model = load_causal_lm(None, model_type="gpt_oss", tiny=True, seed=0)
    eager = load_causal_lm(
        None, model_type="gpt_oss", tiny=True, seed=0, attn_implementation="eager"
    )
    assert model.config._attn_implementation == SINK_ATTENTION
    assert eager.config._attn_implementation == "eager"
    assert model.config.sliding_window < SEQ  # the sliding layers' masks cut keys
    for (name, p), q in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    batch = _batches()[layout]
    loss, grads, calls = _loss_and_grads(model, batch)
    eager_loss, eager_grads, eager_calls = _loss_and_grads(eager, batch)
    assert (calls.calls, eager_calls.calls) == (model.config.num_hidden_layers, 0)
    # the full-attention layers get no mask but on padded rows (transformers passes none for
    # these packed rows either, eager's included): then the sink is key 0 of a causal call
    full_layers = model.config.layer_types.count("full_attention")
    assert calls.causal == (0 if layout == "padded" else full_layers)
    tolerance = TOLERANCES["fp32"]
    assert abs(float(loss / eager_loss) - 1) <= tolerance["loss"]
    assert grads.keys() == eager_grads.keys() and any("sinks" in n for n in grads)
    worst = max(rel_errors(grads, eager_grads).items(), key=lambda kv: kv[1])
    assert worst[1] <= tolerance["grad"], worst


def test_the_default_leaves_other_models_and_asked_implementations_alone() -> None:
    llama = load_causal_lm(None, model_type="llama", tiny=True)
    assert llama.config._attn_implementation == "sdpa"  # no sinks
    asked = load_causal_lm(
        None, model_type="gpt_oss", tiny=True, attn_implementation=SINK_ATTENTION
    )
    assert asked.config._attn_implementation == SINK_ATTENTION
