"""Packing, padding and the loader: row layout, attention isolation through a real HF model,
shuffle repeatability per epoch, exact mid-epoch resume."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import find_packed_sequence_indices

from data_fixtures.helpers import make_sample
from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.data import BatchLoader, Sample, make_loader, pack_rows
from megatrain.data.packing import packed_batch, padded_batch

PAD = 0


def _samples(lengths: list[int], seed: int = 0, all_supervised: bool = False) -> list[Sample]:
    """Samples with random ids in 1..99; the second half of each supervised (or all of it)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, 100, size=n).tolist()
        out.append(make_sample(ids, [all_supervised or i >= n // 2 for i in range(n)]))
    return out


def test_pack_rows_best_fit_decreasing() -> None:
    assert pack_rows([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    lengths = np.random.default_rng(1).integers(1, 25, size=300).tolist()
    rows = pack_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 64
    assert len(rows) == -(-sum(lengths) // 64)  # small items: BFD reaches the lower bound
    with pytest.raises(ValueError, match="65 tokens does not fit a packed row of seq_len=64"):
        pack_rows([65], 64)


def test_packed_row_layout() -> None:
    samples = _samples([5, 3, 4], all_supervised=True)
    assert all(s.labels()[0] != IGNORE_INDEX for s in samples)
    batch = packed_batch([[samples[0], samples[1]], [samples[2]]], seq_len=10, pad_token_id=PAD)
    assert batch.attention_mask is None and batch.input_ids.shape == (2, 10)
    assert batch.position_ids is not None
    assert batch.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2, 0, 1],
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5],
    ]
    row0 = np.concatenate([samples[0].input_ids, samples[1].input_ids, [PAD, PAD]])
    assert batch.input_ids[0].tolist() == row0.tolist()
    expected = np.concatenate([samples[0].labels(), samples[1].labels(), [IGNORE_INDEX] * 2])
    expected[[0, 5]] = IGNORE_INDEX  # the first label of every sample
    assert batch.labels[0].tolist() == expected.tolist()
    assert batch.labels[1, 4:].tolist() == [IGNORE_INDEX] * 6
    assert batch.input_ids[1, 4:].tolist() == [PAD] * 6
    segments = find_packed_sequence_indices(batch.position_ids)
    assert segments is not None
    assert segments.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]]


def test_packed_attention_equals_separate_samples() -> None:
    """A tiny Llama sees each packed sample exactly as it sees the sample alone."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    samples = _samples([7, 5, 9, 3])
    loader = make_loader(
        samples, micro_batch_size=8, seq_len=16, packing=True, pad_token_id=PAD, shuffle=False
    )
    batch = next(iter(loader))
    assert batch.input_ids.shape == (2, 16)  # 9+7 and 5+3 (+ 8 pad)
    with torch.no_grad():
        # use_cache=False: with a cache, HF skips the packed-sequence detection (plain causal mask)
        packed = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits
        for r, row in enumerate(loader.rows or []):
            start = 0
            for i in row:
                ids = torch.from_numpy(samples[i].input_ids.astype(np.int64))[None]
                alone = model(input_ids=ids).logits[0]
                torch.testing.assert_close(packed[r, start : start + len(alone)], alone)
                start += len(alone)


def test_padded_batch_layout() -> None:
    samples = _samples([5, 11, 2])
    batch = padded_batch(samples, pad_token_id=PAD, pad_to_multiple_of=8, max_len=64)
    assert batch.input_ids.shape == (3, 16)
    assert batch.attention_mask is not None and batch.position_ids is not None
    assert batch.attention_mask.sum(1).tolist() == [5, 11, 2]
    assert batch.position_ids.tolist() == [list(range(16))] * 3
    assert batch.labels[0].tolist() == samples[0].labels().tolist() + [IGNORE_INDEX] * 11
    assert batch.input_ids[2].tolist() == samples[2].input_ids.tolist() + [PAD] * 14
    capped = padded_batch(samples, pad_token_id=PAD, pad_to_multiple_of=8, max_len=12)
    assert capped.input_ids.shape == (3, 12)


def _epoch(loader: BatchLoader) -> list[Batch]:
    return list(loader)


def _key(batches: list[Batch]) -> list[list[list[int]]]:
    return [b.input_ids.tolist() for b in batches]


@pytest.mark.parametrize("packing", [False, True])
def test_shuffle_is_repeatable_per_epoch_and_covers_every_sample(packing: bool) -> None:
    samples = _samples(np.random.default_rng(2).integers(2, 30, size=41).tolist())

    def loader(seed: int) -> BatchLoader:
        return make_loader(
            samples, micro_batch_size=4, seq_len=32, packing=packing, pad_token_id=PAD, seed=seed
        )

    a, b = loader(7), loader(7)
    a0, a1, b0 = _epoch(a), _epoch(a), _epoch(b)
    assert _key(a0) == _key(b0) and _key(a0) != _key(a1)
    assert _key(a0) != _key(_epoch(loader(8)))
    assert len(a0) == len(a1) == len(a)
    real = [t for batch in a0 for t in batch.input_ids.flatten().tolist() if t != PAD]
    assert sorted(real) == sorted(t for s in samples for t in s.input_ids.tolist())
    ordered = make_loader(
        samples, micro_batch_size=4, seq_len=32, packing=packing, pad_token_id=PAD, shuffle=False
    )
    assert _key(_epoch(ordered)) == _key(_epoch(ordered))


@pytest.mark.parametrize("packing", [False, True])
def test_resume_mid_epoch_and_across_epochs_gives_the_same_batches(packing: bool) -> None:
    samples = _samples(np.random.default_rng(3).integers(2, 30, size=30).tolist())

    def loader() -> BatchLoader:
        return make_loader(
            samples, micro_batch_size=3, seq_len=32, packing=packing, pad_token_id=PAD, seed=5
        )

    reference = loader()
    per_epoch = len(reference)
    stream = list(
        itertools.islice(
            itertools.chain.from_iterable(iter(reference) for _ in range(3)), 3 * per_epoch
        )
    )
    for stop in (0, 1, per_epoch - 1, per_epoch, per_epoch + 2):
        first = loader()
        consumed = list(itertools.islice(itertools.chain(first, first), stop))
        state = first.state_dict()
        assert (state["epoch"], state["step"]) == divmod(stop, per_epoch)
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [b for _ in range(3) for b in resumed][: 2 * per_epoch - stop]
        assert _key(consumed + rest) == _key(stream[: 2 * per_epoch])


def test_state_from_other_data_or_settings_is_refused() -> None:
    samples = _samples([4, 5, 6, 7])
    state = make_loader(samples, micro_batch_size=2, seq_len=16, packing=False, pad_token_id=0)
    saved = state.state_dict()
    other = make_loader(samples[:3], micro_batch_size=2, seq_len=16, packing=False, pad_token_id=0)
    with pytest.raises(ValueError, match="num_samples: saved 4, now 3"):
        other.load_state_dict(saved)


def test_make_loader_rejects_samples_longer_than_seq_len() -> None:
    with pytest.raises(ValueError, match="a sample has 20 tokens, more than seq_len=16"):
        make_loader(_samples([20]), micro_batch_size=1, seq_len=16, packing=False, pad_token_id=0)
