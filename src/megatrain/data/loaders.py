"""Which loader a data set gets: `make_loader` over samples gives a BatchLoader (loader.py:
packed rows or padded batches), over a pretrain corpus a PretrainLoader (pretrain_loader.py,
a BatchLoader itself). Above both modules, so neither imports the other back."""

from __future__ import annotations

from megatrain.data.loader import BatchLoader
from megatrain.data.packing import pack_rows
from megatrain.data.pretrain import PretrainCorpus
from megatrain.data.pretrain_loader import make_pretrain_loader
from megatrain.data.sample import Sample
from megatrain.data.vision import VisionProcessor


def make_loader(
    samples: list[Sample] | PretrainCorpus,
    *,
    micro_batch_size: int,
    seq_len: int,
    packing: bool,
    pad_token_id: int,
    shuffle: bool = True,
    seed: int = 0,
    pad_to_multiple_of: int = 1,
    vision: VisionProcessor | None = None,
) -> BatchLoader:
    """A BatchLoader over `samples`; with `packing`, rows of exactly `seq_len` tokens.

    A PretrainCorpus (stage pt) always gives rows of exactly `seq_len` tokens cut from its
    document stream (pretrain_loader.py); `packing` and `pad_to_multiple_of` do not apply.
    `vision`: the processor of samples with images (PreparedData.vision)."""
    if isinstance(samples, PretrainCorpus):
        return make_pretrain_loader(
            samples,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            pad_token_id=pad_token_id,
            shuffle=shuffle,
            seed=seed,
        )
    if not samples:
        raise ValueError("no samples to load; check the data statistics for what was dropped")
    if micro_batch_size < 1 or seq_len < 1 or pad_to_multiple_of < 1:
        raise ValueError(
            f"micro_batch_size={micro_batch_size}, seq_len={seq_len}, "
            f"pad_to_multiple_of={pad_to_multiple_of}: each must be >= 1"
        )
    longest = max(s.num_tokens for s in samples)
    if longest > seq_len:
        raise ValueError(
            f"a sample has {longest} tokens, more than seq_len={seq_len}; set "
            f"data.cutoff_len <= seq_len so samples are truncated or dropped before batching"
        )
    rows = pack_rows([s.num_tokens for s in samples], seq_len) if packing else None
    return BatchLoader(
        samples,
        rows=rows,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        shuffle=shuffle,
        seed=seed,
        vision=vision,
    )
