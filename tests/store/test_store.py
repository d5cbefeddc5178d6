"""HostStore and ParamBlock built from a tiny Llama: layout, values, bytes, and the skeleton.

Every check compares against the HF model as loaded (a deep copy taken before the store takes
its weights): each parameter in exactly one block, forward order, decayed parameters first,
master values equal to the HF weights bit for bit, the bf16 shadow equal to torch's own
round-to-nearest-even cast bit for bit, and the rebound model computing the original logits.
"""

from __future__ import annotations

import copy
import gc
import weakref
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megatrain.config import OptimizerConfig
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.store.host import DEFAULT_NO_DECAY, HostStore, ParamBlock

NUM_LAYERS = 3


@dataclass
class Built:
    original: Any  # the HF model with its weights
    skeleton: Any  # the same model after the store took its weights
    store: HostStore
    loaded: list[weakref.ref[torch.Tensor]]  # the HF parameters as loaded (now freed)


def _build(
    tied: bool = False, compute_dtype: torch.dtype = torch.bfloat16, **store_kwargs: object
) -> Built:
    hf = load_causal_lm(
        None, model_type="llama", tiny=True, config_overrides={"tie_word_embeddings": tied}
    )
    original = copy.deepcopy(hf)
    loaded = [weakref.ref(p) for p in hf.parameters()]
    store = HostStore(discover(hf), compute_dtype=compute_dtype, **store_kwargs)
    return Built(original, hf, store, loaded)


@pytest.fixture(scope="module")
def bf16() -> Built:
    return _build()


@pytest.fixture(scope="module")
def fp32() -> Built:
    return _build(compute_dtype=torch.float32)


@pytest.fixture(scope="module")
def tied() -> Built:
    return _build(tied=True)


def _entries(block: ParamBlock) -> list[str]:
    return [e.full_name for e in block.entries]


def test_every_parameter_in_one_block_in_forward_order(bf16: Built) -> None:
    store = bf16.store
    assert [b.name for b in store.blocks] == ["embed", "layer.0", "layer.1", "layer.2", "head"]
    assert _entries(store.embed) == ["model.embed_tokens.weight"]
    for i, layer in enumerate(store.layers):
        assert all(name.startswith(f"model.layers.{i}.") for name in _entries(layer))
        assert {e.root for e in layer.entries} == {"layer"}
    assert sorted(_entries(store.head)) == ["lm_head.weight", "model.norm.weight"]
    stored = [name for b in store.blocks for name in _entries(b)]
    assert sorted(stored) == sorted(n for n, _ in bf16.original.named_parameters())


def test_tied_embedding_is_stored_once_and_rebound_tied(tied: Built) -> None:
    store, original = tied.store, tied.original
    assert original.lm_head.weight is original.model.embed_tokens.weight
    assert _entries(store.embed) == ["model.embed_tokens.weight"]
    assert _entries(store.head) == ["model.norm.weight"]
    unique = sum(p.numel() for p in original.parameters())  # parameters() yields a tie once
    assert store.numel == unique
    # both owners point at one meta tensor, and at one bound tensor inside bound()
    assert tied.skeleton.lm_head.weight is tied.skeleton.model.embed_tokens.weight
    with store.bound() as model:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_block_layout_is_contiguous_with_decayed_entries_first(bf16: Built) -> None:
    for block in bf16.store.blocks:
        offset = 0
        for entry in block.entries:
            assert entry.offset == offset
            offset += entry.numel
        assert offset == block.numel == block.master.numel()
        decays = [e.decay for e in block.entries]
        assert decays == sorted(decays, reverse=True)  # all True before any False
        assert block.decay_numel == sum(e.numel for e in block.entries if e.decay)


def test_default_decay_is_matrices_except_norms(bf16: Built) -> None:
    assert tuple(OptimizerConfig().no_decay) == DEFAULT_NO_DECAY
    no_decay = {e.full_name for b in bf16.store.blocks for e in b.entries if not e.decay}
    norms = {n for n, p in bf16.original.named_parameters() if p.dim() == 1}
    assert no_decay == norms
    assert all("norm" in n for n in norms)


def test_no_decay_patterns_and_decay_1d() -> None:
    """Patterns are case-insensitive regex searches in the full name; decay_1d lets 1-D decay."""
    built = _build(no_decay=("EMBED", r"^model\.norm\."), decay_1d=True)
    no_decay = {e.full_name for b in built.store.blocks for e in b.entries if not e.decay}
    assert no_decay == {"model.embed_tokens.weight", "model.norm.weight"}
    assert built.store.embed.decay_numel == 0
    layer = built.store.layers[0]
    assert layer.decay_numel == layer.numel  # layer norms decay too with decay_1d


def test_view_shapes_and_master_equal_the_hf_weights(bf16: Built) -> None:
    reference = dict(bf16.original.named_parameters())
    for block in bf16.store.blocks:
        for entry in block.entries:
            view = block.view(block.master, entry)
            assert view.shape == entry.shape == reference[entry.full_name].shape
            assert view.dtype == torch.float32
            assert torch.equal(view, reference[entry.full_name].detach())


def test_bf16_shadow_is_the_master_rounded_by_torch(bf16: Built) -> None:
    for block in bf16.store.blocks:
        assert block.shadow is not None and block.grad is None
        assert block.source is block.shadow and block.grad_landing is block.shadow
        expected = block.master.to(torch.bfloat16)
        assert torch.equal(block.shadow.view(torch.int16), expected.view(torch.int16))


def test_refresh_shadow_follows_the_master() -> None:
    block = _build().store.layers[1]
    assert block.shadow is not None
    block.master.mul_(3.0).add_(1e-3)
    block.refresh_shadow()
    expected = block.master.to(torch.bfloat16)
    assert torch.equal(block.shadow.view(torch.int16), expected.view(torch.int16))


def test_fp32_compute_copies_from_the_master(fp32: Built) -> None:
    for block in fp32.store.blocks:
        assert block.shadow is None and block.grad is not None
        assert block.source is block.master and block.grad_landing is block.grad
        assert block.grad.dtype == torch.float32 and block.grad.numel() == block.numel


def test_unsupported_compute_dtype_is_refused() -> None:
    hf = load_causal_lm(None, model_type="llama", tiny=True)
    with pytest.raises(ValueError, match="float16"):
        HostStore(discover(hf), compute_dtype=torch.float16)


def test_bytes_per_parameter(bf16: Built, fp32: Built) -> None:
    numel = sum(p.numel() for p in bf16.original.parameters())
    assert bf16.store.numel == fp32.store.numel == numel
    # master, exp_avg, exp_avg_sq: 3 x 4 bytes; bf16 shadow 2 bytes, or fp32 gradient 4 bytes
    assert bf16.store.host_bytes() == 14 * numel
    assert fp32.store.host_bytes() == 16 * numel
    for block in bf16.store.blocks:
        assert block.host_bytes() == 14 * block.numel


def test_the_skeleton_holds_no_weights(bf16: Built) -> None:
    params = list(bf16.skeleton.parameters())
    assert params and all(p.is_meta for p in params)
    gc.collect()
    # the loaded weights are gone: host memory holds the model once, in the store
    assert bf16.loaded and all(ref() is None for ref in bf16.loaded)


def _logits(model: Any) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("which", ["bf16", "fp32", "tied"])
def test_bound_model_computes_the_original_logits(
    which: str, request: pytest.FixtureRequest
) -> None:
    built: Built = request.getfixturevalue(which)
    ref = _logits(built.original)
    with built.store.bound() as model:
        assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())
        out = _logits(model)
    assert all(p.is_meta for p in built.skeleton.parameters())  # weightless again afterwards
    # Same weights and kernels; only memory alignment differs, which may reorder the fp32 sums
    # of K <= 128 terms (hidden 64, MLP 128): each moves by at most K * 2**-24 of its magnitude.
    atol = 128 * 2**-24 * ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=0.0, atol=atol)


def test_bound_bf16_binds_the_shadow(bf16: Built) -> None:
    with bf16.store.bound(torch.bfloat16) as model:
        named = dict(model.named_parameters())
        for block in bf16.store.blocks:
            assert block.shadow is not None
            for entry in block.entries:
                p = named[entry.full_name]
                assert p.dtype == torch.bfloat16
                assert p.data_ptr() == block.view(block.shadow, entry).data_ptr()  # no copy
                # its own storage, just this parameter's bytes (for save_pretrained)
                assert p.untyped_storage().nbytes() == 2 * entry.numel


def test_bound_bf16_in_fp32_compute_is_the_cast_master(fp32: Built) -> None:
    with fp32.store.bound(torch.bfloat16) as model:
        named = dict(model.named_parameters())
        for block in fp32.store.blocks:
            for entry in block.entries:
                expected = block.view(block.master, entry).to(torch.bfloat16)
                assert torch.equal(named[entry.full_name], expected)
