"""Stage pt data: raw-text data sets -> a `PretrainCorpus`, a table of documents over token files.

Per data set, in order: its data files (a file, the files of a folder, or a hub snapshot's files
of the split) are tokenized through the cache (corpus.py), at most `max_samples` rows read in all;
the registry's `num_samples` then draws documents (seeded, with repetition past the count, as for
sft). Data sets are concatenated in the order given.

A corpus never holds token ids as Python objects: it is the cached token arrays (memory maps) and
three int arrays with one entry per document (which file, where it starts, how long), so a split
or a draw is an index into those arrays. Documents are consumed in table order as one stream of
tokens that the loader (pretrain_loader.py) cuts into rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.data.corpus import TokenFile, default_cache_dir, tokenize_file, tokenizer_fingerprint
from megatrain.data.readers import TEXT_SUFFIXES, data_files, download_hub_dataset
from megatrain.data.registry import REGISTRY_FILE, DatasetSpec
from megatrain.data.sample import DataStats, held_out_mask

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class PretrainCorpus:
    """Documents, in training order, over token arrays; `len()` is the number of documents."""

    token_files: tuple[np.ndarray, ...]
    doc_file: np.ndarray  # [D] int64: index into token_files
    doc_start: np.ndarray  # [D] int64: first token of the document in its token file
    doc_len: np.ndarray  # [D] int64: tokens of the document, eos included
    neat_packing: bool = False  # the loader restarts attention / positions per document

    def __len__(self) -> int:
        return int(self.doc_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.doc_len.sum())

    def document(self, i: int) -> np.ndarray:
        start = int(self.doc_start[i])
        return self.token_files[int(self.doc_file[i])][start : start + int(self.doc_len[i])]

    def select(self, index: np.ndarray) -> PretrainCorpus:
        """The documents `index` (any order, repeats allowed), in that order."""
        return PretrainCorpus(
            self.token_files,
            self.doc_file[index],
            self.doc_start[index],
            self.doc_len[index],
            self.neat_packing,
        )

    @staticmethod
    def of(files: list[TokenFile], *, neat_packing: bool) -> PretrainCorpus:
        empty = np.zeros(0, np.int64)
        lens = [f.doc_lens.astype(np.int64) for f in files]
        starts = [np.cumsum(n) - n for n in lens]
        return PretrainCorpus(
            tuple(f.tokens for f in files),
            np.concatenate([empty, *(np.full(len(n), i, np.int64) for i, n in enumerate(lens))]),
            np.concatenate([empty, *starts]),
            np.concatenate([empty, *lens]),
            neat_packing,
        )

    @staticmethod
    def concat(parts: list[PretrainCorpus], *, neat_packing: bool) -> PretrainCorpus:
        offsets = np.cumsum([0] + [len(p.token_files) for p in parts])
        return PretrainCorpus(
            tuple(t for p in parts for t in p.token_files),
            np.concatenate([p.doc_file + o for p, o in zip(parts, offsets, strict=False)]),
            np.concatenate([p.doc_start for p in parts]),
            np.concatenate([p.doc_len for p in parts]),
            neat_packing,
        )


def load_corpus(
    specs: list[DatasetSpec],
    tokenizer: Any,
    *,
    max_samples: int | None,
    seed: int,
    neat_packing: bool,
    cache_dir: str | None,
) -> tuple[PretrainCorpus, DataStats]:
    """The documents of `specs`, concatenated, and the statistics of all their rows."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    fingerprint = tokenizer_fingerprint(tokenizer)
    parts: list[PretrainCorpus] = []
    total = DataStats()
    for spec in specs:
        _check_spec(spec)
        files: list[TokenFile] = []
        stats = DataStats()
        for file in _files_of(spec):
            limit = None if max_samples is None else max_samples - stats.rows_read
            if limit == 0:
                break
            tokenized = tokenize_file(
                file,
                column=spec.text,
                tokenizer=tokenizer,
                fingerprint=fingerprint,
                cache_dir=cache,
                limit=limit,
            )
            files.append(tokenized)
            stats.add(tokenized.stats)
        corpus = PretrainCorpus.of(files, neat_packing=neat_packing)
        if spec.num_samples is not None and len(corpus):
            corpus = corpus.select(_draw(len(corpus), spec.num_samples, seed))
            stats.kept, stats.num_tokens = len(corpus), corpus.num_tokens
            stats.num_target_tokens = corpus.num_tokens
            stats.rows_read = stats.kept + stats.num_dropped  # drawn documents count as read
        log = logger.warning if stats.dropped else logger.info
        log("data set %s (%s): %s", spec.name, spec.path, stats.describe())
        parts.append(corpus)
        total.add(stats)
    return PretrainCorpus.concat(parts, neat_packing=neat_packing), total


def split_corpus(
    corpus: PretrainCorpus, *, val_size: float, seed: int
) -> tuple[PretrainCorpus, PretrainCorpus]:
    """(train, eval): a seeded random draw of `val_size` documents (fraction or count)."""
    held_out = held_out_mask(len(corpus), val_size=val_size, seed=seed, unit="documents")
    return corpus.select(np.flatnonzero(~held_out)), corpus.select(np.flatnonzero(held_out))


def _draw(num_docs: int, num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picked = rng.permutation(num_docs)[:num_samples]
    extra = num_samples - len(picked)
    if extra > 0:
        picked = np.concatenate([picked, rng.choice(num_docs, extra)])
    return picked


def _check_spec(spec: DatasetSpec) -> None:
    if spec.formatting != "alpaca":
        raise ValueError(
            f"data set {spec.name!r} is registered with formatting {spec.formatting!r} "
            "(conversations: SFT data), but data.stage is pt (raw text); set data.stage: sft, or "
            f'register a raw-text set in {REGISTRY_FILE} as `"columns": {{"prompt": "text"}}`'
        )


def _files_of(spec: DatasetSpec) -> list[Path]:
    if spec.load_from == "hf_hub":
        return download_hub_dataset(
            spec.path,
            name=spec.name,
            revision=spec.revision,
            folder=spec.folder,
            subset=spec.subset,
            split=spec.split,
            suffixes=TEXT_SUFFIXES,
        )
    return data_files(Path(spec.path), TEXT_SUFFIXES)
