"""The loader of stage pt: a corpus's documents as one token stream, cut into rows of `seq_len`.

Rows: row r is tokens [r * seq_len, (r + 1) * seq_len) of the documents concatenated in corpus
order (each ends with its eos), so a document may span rows; the tokens after the last full row
are not trained on (as in LLaMA-Factory's pt stage), `tokens_dropped` counts them. A row is
built on demand from the memory-mapped token files: nothing of the corpus is held per token.

The Batch of a row (attention_mask None, no padding ever):
- neat_packing False: position ids 0..seq_len-1 and labels = input_ids: a plain causal window,
  every token after the first a target (the eos of a document predicts the next one's start);
- neat_packing True: position ids restart at 0 at every document start inside the row (a row that
  opens inside a document starts at 0 too), which Hugging Face turns into block-diagonal
  attention; the label at each restart is IGNORE_INDEX, so nothing predicts across documents.

Order and resume: BatchLoader's (a seeded per-epoch shuffle of whole rows; {"epoch", "step"} and
a fingerprint of the corpus and settings).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.data.loader import BatchLoader
from megatrain.data.pretrain import PretrainCorpus


class PretrainLoader(BatchLoader):
    """Rows of exactly `seq_len` tokens cut from the document stream of a PretrainCorpus."""

    def __init__(
        self,
        corpus: PretrainCorpus,
        *,
        micro_batch_size: int,
        seq_len: int,
        pad_token_id: int,
        shuffle: bool,
        seed: int,
    ) -> None:
        super().__init__(
            [],
            rows=None,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=1,
            shuffle=shuffle,
            seed=seed,
        )
        self.corpus = corpus
        self.doc_bounds = np.concatenate([[0], np.cumsum(corpus.doc_len)]).astype(np.int64)
        self.neat_packing = corpus.neat_packing

    @property
    def packing(self) -> bool:
        return True

    @property
    def num_rows(self) -> int:
        return self.corpus.num_tokens // self.seq_len

    @property
    def tokens_dropped(self) -> int:
        """Tokens after the last full row, not trained on."""
        return self.corpus.num_tokens - self.num_rows * self.seq_len

    def supervised_tokens_per_epoch(self) -> int:
        """Target tokens of one epoch, as `Batch.num_target_tokens` counts them."""
        per_row = self.num_rows * (self.seq_len - 1)
        if not self.neat_packing:
            return per_row
        starts = self.doc_bounds[:-1]
        inside = (starts < self.num_rows * self.seq_len) & (starts % self.seq_len != 0)
        return per_row - int(inside.sum())

    def row(self, r: int) -> tuple[np.ndarray, list[int]]:
        """Token ids of row `r` and the offsets where a segment (document piece) starts."""
        lo, hi = r * self.seq_len, (r + 1) * self.seq_len
        i = int(np.searchsorted(self.doc_bounds, lo, side="right")) - 1
        ids = np.empty(self.seq_len, dtype=np.int64)
        starts: list[int] = []
        pos = lo
        while pos < hi:
            doc_lo, doc_hi = int(self.doc_bounds[i]), int(self.doc_bounds[i + 1])
            end = min(doc_hi, hi)
            if pos in (lo, doc_lo):
                starts.append(pos - lo)
            ids[pos - lo : end - lo] = self.corpus.document(i)[pos - doc_lo : end - doc_lo]
            pos, i = end, i + 1
        return ids, starts

    def _make_batch(self, picked: np.ndarray) -> Batch:
        rows = [self.row(int(r)) for r in picked]
        input_ids = np.stack([ids for ids, _ in rows])
        labels = input_ids.copy()
        position_ids = np.broadcast_to(np.arange(self.seq_len), input_ids.shape).copy()
        if self.neat_packing:
            for b, (_, starts) in enumerate(rows):
                for s, e in zip(starts, [*starts[1:], self.seq_len], strict=True):
                    position_ids[b, s:e] = np.arange(e - s)
                    labels[b, s] = IGNORE_INDEX
        return Batch(
            input_ids=torch.from_numpy(input_ids),
            labels=torch.from_numpy(labels),
            attention_mask=None,
            position_ids=torch.from_numpy(position_ids),
        )

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.corpus.doc_len.tobytes())
        digest.update(self.corpus.doc_start.tobytes())
        digest.update(self.corpus.doc_file.tobytes())
        return {
            "stage": "pt",
            "num_documents": len(self.corpus),
            "num_tokens": self.corpus.num_tokens,
            "documents_sha256": digest.hexdigest(),
            "num_rows": self.num_rows,
            "neat_packing": self.neat_packing,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }


def make_pretrain_loader(
    corpus: PretrainCorpus,
    *,
    micro_batch_size: int,
    seq_len: int,
    pad_token_id: int,
    shuffle: bool,
    seed: int,
) -> PretrainLoader:
    if micro_batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must be >= 1 and seq_len={seq_len} >= 2"
        )
    loader = PretrainLoader(
        corpus,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        pad_token_id=pad_token_id,
        shuffle=shuffle,
        seed=seed,
    )
    if loader.num_rows == 0:
        raise ValueError(
            f"the text holds {corpus.num_tokens} tokens in {len(corpus)} documents, fewer than "
            f"one row of seq_len={seq_len}: add text, lower the seq_len (training.seq_len or "
            "data.cutoff_len), or for an evaluation split raise data.val_size"
        )
    return loader
