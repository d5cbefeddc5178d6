"""The static-cache decoding path (recipes/grpo/decode.py) on the CPU, where each step runs
eagerly: greedy tokens equal transformers' `generate` (batched, as rollout.generate runs it,
and each prompt alone) for llama (sdpa), qwen3 (eager attention, tied head) and qwen3_5_text
(linear-attention layers beside full attention: left padding must not reach their recurrent
state); completions stop at the first EOS; EOS is suppressed before min_new_tokens; sampling
is reproducible from its seed and draws from exactly the distribution transformers'
temperature and top-p warpers leave; the step a CUDA graph captures issues no op that needs
the host."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from megatrain.planning.rollout import state_bytes_per_sequence
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.decode import STOP_CHECK_STEPS, _Decoder, pick_tokens, static_generate
from megatrain.recipes.grpo.decode_support import packed_attention
from megatrain.recipes.grpo.rollout import device_model, generate
from megatrain.verify import verify_config

NEW = STOP_CHECK_STEPS + 8  # past one stop check


def _setup(model_type: str, attn: str, tied: bool) -> tuple[RunBuilder, object, object, object]:
    cfg = verify_config(
        None,
        ["--model.attn_implementation", attn],
        model_type=model_type,
        tiny=True,
        config_overrides={"tie_word_embeddings": tied},
    )
    builder = RunBuilder(cfg)
    reference = builder.model().causal_lm.eval()  # same seed: the same initial weights
    structure = builder.model()
    return builder, reference, structure, builder.store(structure)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]


@pytest.mark.parametrize(
    ("model_type", "attn", "tied"),
    [("llama", "sdpa", False), ("qwen3", "eager", True), ("qwen3_5_text", "sdpa", False)],
)
def test_static_greedy_equals_transformers_generate(model_type: str, attn: str, tied: bool) -> None:
    builder, reference, structure, store = _setup(model_type, attn, tied)
    assert reference.config._attn_implementation == attn
    prompts = _prompts(reference.config.vocab_size)
    kw = {"max_new_tokens": NEW, "pad_token_id": 0, "do_sample": False}
    with device_model(structure, store, builder.device) as model:
        free = generate(model, prompts, eos_token_ids=[1], **kw).completions  # 1: never drawn
        eos = [free[0][4]]  # a token row 0 draws: rows that draw it stop there
        eager = generate(model, prompts, eos_token_ids=eos, **kw)
        static = static_generate(model, prompts, eos_token_ids=eos, cache_len=40, **kw)
    assert all(len(c) == NEW for c in free)
    assert static.completions == eager.completions and static.clipped == eager.clipped
    assert static.completions[0] == free[0][: free[0].index(eos[0]) + 1]  # stopped at its EOS
    for prompt, completion in zip(prompts, static.completions, strict=True):
        ids = torch.tensor([prompt])  # one prompt alone: no padding at all in the reference
        out = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
        assert completion == out[0, len(prompt) :].tolist()[: len(completion)]


def test_sampling_is_seeded_and_min_new_tokens_holds_eos_back() -> None:
    builder, reference, structure, store = _setup("llama", "sdpa", False)
    prompts = _prompts(reference.config.vocab_size)
    kw = {"max_new_tokens": NEW, "pad_token_id": 0, "do_sample": True, "temperature": 1.5}
    with device_model(structure, store, builder.device) as model:

        def sample(seed: int, eos: int, **extra: int) -> list[list[int]]:
            return static_generate(
                model, prompts, eos_token_ids=[eos], seed=seed, top_p=0.9, **kw, **extra
            ).completions

        first = sample(1, 1)
        assert first == sample(1, 1) != sample(2, 1)
        eos = first[0][2]  # row 0 draws it third: from the same seed it stops there
        assert sample(1, eos)[0] == first[0][:3]
        held = sample(1, eos, min_new_tokens=6)
        assert all(eos not in c[:5] for c in held)  # the 6th token may be EOS, none before
        full = sample(1, eos, min_new_tokens=NEW)  # the bench's forced full length
        assert all(len(c) == NEW and eos not in c for c in full)


def test_pick_tokens_samples_transformers_warped_distribution() -> None:
    """Rows of the same logits: each token's share of draws is its probability after
    transformers' temperature and top-p warpers, within 5 binomial standard deviations."""
    gen = torch.Generator().manual_seed(0)
    logits_V = torch.randn(12, generator=gen, dtype=torch.float64) * 2
    temperature, top_p = 0.7, 0.8
    tempered = TemperatureLogitsWarper(temperature)(None, logits_V[None])
    warped = TopPLogitsWarper(top_p)(None, tempered)
    probs = warped.softmax(-1)[0]
    assert 1 < int((probs > 0).sum()) < 12  # top-p removes some tokens, keeps several
    draws = 40_000
    torch.manual_seed(0)
    picked = pick_tokens(
        logits_V.float().expand(draws, -1),
        eos_bias_V=torch.zeros(12),
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
    )
    share = torch.bincount(picked, minlength=12).double() / draws
    for p, s in zip(probs.tolist(), share.tolist(), strict=True):
        assert abs(s - p) <= 5 * math.sqrt(p * (1 - p) / draws)  # p = 0: never drawn
    greedy = pick_tokens(
        logits_V.float()[None],
        eos_bias_V=torch.zeros(12).index_fill(0, logits_V.argmax()[None], -math.inf),
        do_sample=False,
        temperature=1.0,
        top_p=1.0,
    )
    assert greedy.item() == logits_V.topk(2).indices[1].item()  # the EOS bias removes the top


class _HostReads(TorchDispatchMode):
    """Records the ops a CUDA graph cannot hold: reading a device value on the host, shapes that
    depend on data, tensors made from host data (a host-to-device copy mid-step)."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh", "equal")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen += 1
        name = str(func)
        bool_index = name.startswith("aten.index.") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if bool_index or any(f in name for f in self.FORBIDDEN):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_5_text"])
def test_decoding_step_reads_nothing_on_the_host(model_type: str) -> None:
    """What the CUDA graph captures (one _Decoder.step, sampling with top-p, EOS held back)
    issues no op that syncs with the host or needs host data: checked op by op on the CPU."""
    builder, reference, structure, store = _setup(model_type, "sdpa", False)
    with device_model(structure, store, builder.device) as model, torch.no_grad():
        dec = _Decoder(
            model,
            _prompts(reference.config.vocab_size),
            cache_len=16,
            max_new_tokens=4,
            pad_token_id=0,
            eos_token_ids=[1, 2],
            sampling={"do_sample": True, "temperature": 0.9, "top_p": 0.8},
        )
        dec.suppress_eos(True)
        dec.prefill()
        with _HostReads() as mode:
            dec.step()
    assert mode.seen > 50 and mode.ops == []


def test_decode_attention_packs_groups_exactly() -> None:
    """One query token, 3 key/value heads of 4 query heads each, a padding mask: the packed
    attention equals softmax attention in float64 with every key/value head repeated."""
    gen = torch.Generator().manual_seed(0)
    n, kv_heads, groups, keys, width = 2, 3, 4, 16, 8
    query = torch.randn(n, kv_heads * groups, 1, width, generator=gen)
    key, value = (torch.randn(n, kv_heads, keys, width, generator=gen) for _ in range(2))
    mask = torch.rand(n, 1, 1, keys, generator=gen) < 0.7
    mask[..., 0] = True
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    out, _ = packed_attention(module, query, key, value, mask, scaling=width**-0.5)
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = (query.double() @ k64.transpose(-1, -2)) * width**-0.5
    probs = scores.masked_fill(~mask, -math.inf).softmax(-1)
    expected = (probs @ v64).transpose(1, 2)  # [n, 1, heads, width], as the layer reshapes it
    # fp32: each output sums <= 16 products of |v| <= max|v|, rounding ~ keys x eps each
    bound = 4 * keys * torch.finfo(torch.float32).eps * float(value.abs().max())
    assert out.shape == expected.shape and float((out.double() - expected).abs().max()) < bound


def test_rollout_model_waits_for_each_block_before_reading_it() -> None:
    """`ready(block)` (the engine's wait for a block's update) runs once per block, in the
    store's forward order, each before that block's weights are copied; the streamed path
    waits for every block before it returns the model."""
    builder, _, structure, store = _setup("llama", "sdpa", False)
    seen: list[str] = []

    def ready(block: object) -> None:
        seen.append(block.name)  # type: ignore[attr-defined]
        block.source.fill_(0.0)  # type: ignore[attr-defined]  # read after this call

    with device_model(structure, store, builder.device, ready=ready) as model:
        assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
    assert seen == [b.name for b in store.blocks]
    seen.clear()
    with device_model(structure, store, builder.device, streamed=True, num_slots=2, ready=ready):
        assert seen == [b.name for b in store.blocks]


def test_planned_linear_attention_states_are_what_the_cache_holds() -> None:
    """The rollout plan's linear-attention states (planning/rollout.py) are the bytes the
    static cache holds per sequence after the prefill: each gated-delta-rule layer's float32
    recurrent state and its convolution's last inputs; the full-attention layers add none."""
    builder, reference, structure, store = _setup("qwen3_5_text", "sdpa", False)
    prompts = _prompts(reference.config.vocab_size)
    with device_model(structure, store, builder.device) as model, torch.no_grad():
        dec = _Decoder(
            model,
            prompts,
            cache_len=16,
            max_new_tokens=4,
            pad_token_id=0,
            eos_token_ids=[1],
            sampling={"do_sample": False, "temperature": 1.0, "top_p": 1.0},
        )
        dec.prefill()
    held = [
        t
        for layer in dec.cache.layers
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
        for t in states.values()
    ]
    assert len(held) == 2 * reference.config.layer_types.count("linear_attention") > 0
    assert all(t.shape[0] == len(prompts) for t in held)
    per_sequence = sum(t.numel() * t.element_size() for t in held) // len(prompts)
    assert state_bytes_per_sequence(builder.spec) == per_sequence
