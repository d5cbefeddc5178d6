"""The tokenized-corpus cache of stage pt: one data file -> token ids and document lengths on disk.

`tokenize_file` streams the rows of one file (readers.read_file), tokenizes the text column in
batches of about BATCH_CHARS characters and appends the ids to a file, so memory stays bounded by
one batch whatever the corpus size. A document is the tokenizer's ids of its text (with whatever
special tokens the tokenizer adds, e.g. a bos) followed by the eos token unless the tokenizer
already ended it with one. Rows without the column, with a non-string or a blank text are dropped
and counted (DataStats), never silently.

Cache entry, `<cache_dir>/pt/<key>/`: `tokens.bin` (uint16 when the vocabulary fits, else uint32;
read back as a memory map), `doc_lens.npy` (int64) and `meta.json` (dtype, counts, statistics).
The key hashes the file's resolved path, size and mtime, the tokenizer's fingerprint, the column,
the row limit and CACHE_VERSION: a changed file, tokenizer or setting is a new entry, never a
stale hit. An entry is written under a temporary name in the same folder and renamed into place,
so a crash leaves no half entry; only that temporary folder is ever deleted, never an entry or
anything else this run did not write.

Invariant: `doc_lens.sum() == len(tokens)`; an entry is immutable once renamed into place.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.data.formats import MALFORMED_ROW, MISSING_COLUMN
from megatrain.data.readers import read_file
from megatrain.data.registry import REGISTRY_FILE, sft_format_of
from megatrain.data.sample import DataStats

CACHE_VERSION = 1
BATCH_CHARS = 2 << 20  # text tokenized per tokenizer call: bounds memory, amortizes the call
EMPTY_TEXT = "empty_text"
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class TokenFile:
    """One data file, tokenized: its documents back to back."""

    tokens: np.ndarray  # [N] uint16 | uint32, usually a read-only memory map
    doc_lens: np.ndarray  # [D] int64, tokens per document, eos included
    stats: DataStats
    cache_hit: bool


def default_cache_dir() -> Path:
    env = os.environ.get("MEGATRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megatrain"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides the ids: vocabulary, merges, normalizer, special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h = hashlib.sha256()
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(json.dumps([specials, tokenizer.eos_token_id, len(tokenizer)]).encode())
    return h.hexdigest()


def tokenize_file(
    file: Path,
    *,
    column: str,
    tokenizer: Any,
    fingerprint: str,
    cache_dir: Path,
    limit: int | None = None,
) -> TokenFile:
    """The tokenized documents of `file` (at most `limit` rows read), from the cache if there."""
    eos = tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise ValueError(
            "data.stage: pt puts an eos token after every document, but the tokenizer has none; "
            "use a tokenizer with an eos token (tokenizer.eos_token)"
        )
    stat = file.stat()
    key_fields = [CACHE_VERSION, str(file.resolve()), stat.st_size, stat.st_mtime_ns]
    key_fields += [fingerprint, column, limit]
    key = hashlib.sha256(json.dumps(key_fields).encode()).hexdigest()[:32]
    entry = cache_dir / "pt" / key
    if entry.is_dir():
        return _load(entry, cache_hit=True)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write(file, tmp, column=column, tokenizer=tokenizer, eos=eos, limit=limit)
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():  # not a concurrent writer's finished entry: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # our own temporary folder (or a duplicate of a finished entry)
    return _load(entry, cache_hit=False)


def _load(entry: Path, *, cache_hit: bool) -> TokenFile:
    meta = json.loads((entry / "meta.json").read_text())
    n = int(meta["num_tokens"])
    dtype = np.dtype(meta["dtype"])
    tokens_path = entry / "tokens.bin"
    if tokens_path.stat().st_size != n * dtype.itemsize:
        raise ValueError(
            f"{entry}: the cache entry is damaged ({tokens_path} is not {n} tokens); remove that "
            "folder and run again to tokenize the file anew"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    doc_lens = np.load(entry / "doc_lens.npy")
    stats = DataStats(**meta["stats"])
    assert int(doc_lens.sum()) == n, (entry, int(doc_lens.sum()), n)
    return TokenFile(tokens=tokens, doc_lens=doc_lens, stats=stats, cache_hit=cache_hit)


def _write(
    file: Path, out: Path, *, column: str, tokenizer: Any, eos: int, limit: int | None
) -> None:
    dtype = np.dtype(np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32)
    stats = DataStats()
    doc_lens: list[np.ndarray] = []
    progress = _Progress(file)
    with (out / "tokens.bin").open("wb") as f:
        for texts in _text_batches(file, column, stats, limit):
            # verbose=False: documents are cut into rows of seq_len later, so transformers'
            # "Token indices sequence length is longer than ..." warning does not apply
            ids = tokenizer(
                texts, add_special_tokens=True, return_attention_mask=False, verbose=False
            )["input_ids"]
            for doc in ids:
                if not doc or doc[-1] != eos:
                    doc.append(eos)
            lens = np.fromiter((len(doc) for doc in ids), dtype=np.int64, count=len(ids))
            total = int(lens.sum())
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total)
            flat.tofile(f)
            doc_lens.append(lens)
            stats.kept += len(ids)
            stats.num_tokens += total
            progress.update(stats, sum(len(t) for t in texts))
    stats.num_target_tokens = stats.num_tokens  # raw text: every token is a label
    progress.done(stats)
    lens_all = np.concatenate(doc_lens) if doc_lens else np.zeros(0, np.int64)
    np.save(out / "doc_lens.npy", lens_all)
    meta = {"source": str(file), "dtype": dtype.name, "num_tokens": stats.num_tokens}
    meta["stats"] = stats.to_dict()
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def _text_batches(
    file: Path, column: str, stats: DataStats, limit: int | None
) -> Iterator[list[str]]:
    """Batches of non-blank texts of `file`; other rows are counted as dropped in `stats`."""
    batch: list[str] = []
    chars = 0
    for index, row in enumerate(read_file(file)):
        if limit is not None and index >= limit:
            break
        stats.rows_read += 1
        if not isinstance(row, dict):
            raise ValueError(
                f"{file}: row {index + 1} is {type(row).__name__}, expected an object with a "
                f"{column!r} text column"
            )
        if index == 0 and column not in row:
            _refuse_first_row(file, row, column)
        text = row.get(column)
        if column not in row:
            stats.drop(MISSING_COLUMN)
        elif not isinstance(text, str):
            stats.drop(MALFORMED_ROW)
        elif not text.strip():
            stats.drop(EMPTY_TEXT)
        else:
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _refuse_first_row(file: Path, row: dict[str, Any], column: str) -> None:
    detected = sft_format_of(row)
    if detected is not None:
        raise ValueError(
            f"{file}: the rows are {detected} conversations (keys {sorted(row)}), SFT data, but "
            f"data.stage is pt (raw text from column {column!r}); set data.stage: sft to train on "
            "conversations, or give a raw-text data set"
        )
    raise ValueError(
        f"{file}: the first row has no text column {column!r} (keys {sorted(row)}); for "
        f"data.stage: pt name the text column in {REGISTRY_FILE} as "
        '`"columns": {"prompt": "<column>"}`, or use a .txt file (one document per line)'
    )


class _Progress:
    """Tokenization progress on stderr, at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.size_mb = file.stat().st_size / 1e6
        self.text_mb = 0.0
        self.start = self.last = time.monotonic()

    def update(self, stats: DataStats, chars: int) -> None:
        self.text_mb += chars / 1e6
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(f"tokenizing {self.file}: {self._counts(stats)}", file=sys.stderr, flush=True)

    def done(self, stats: DataStats) -> None:
        print(f"tokenized {self.file}: {self._counts(stats)}", file=sys.stderr, flush=True)

    def _counts(self, stats: DataStats) -> str:
        elapsed = time.monotonic() - self.start
        return (
            f"{stats.kept} documents, {stats.num_tokens} tokens, {self.text_mb:.0f} MB of text "
            f"(file {self.size_mb:.0f} MB) in {elapsed:.0f} s"
        )
