"""The tokenized-corpus cache of stage pt: a second prepare does not tokenize, a changed file,
tokenizer or setting is a new entry, a failed tokenization leaves nothing behind, and tokenizing
streams (Python memory bounded by one batch, not by the corpus)."""

from __future__ import annotations

import os
import random
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_fixtures.helpers import demo_tokenizer
from data_fixtures.pt_corpus import random_text, reference_document, write_lf_corpus
from megatrain.data import DataConfig, prepare_data
from megatrain.data import corpus as corpus_module
from megatrain.data.pretrain import PretrainCorpus


class CountingTokenizer:
    """The real demo tokenizer, counting the texts it is asked to tokenize."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.texts_tokenized = 0

    def __call__(self, texts: Any, **kwargs: Any) -> Any:
        self.texts_tokenized += len(texts) if isinstance(texts, list) else 1
        return self._tokenizer(texts, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _cfg(folder: Path, **kw: Any) -> DataConfig:
    base = dict(stage="pt", dataset="c4_demo,wiki_demo", dataset_dir=str(folder))
    return DataConfig(**{**base, "cache_dir": str(folder.parent / "cache"), **kw})


def _docs(corpus: Any) -> list[list[int]]:
    assert isinstance(corpus, PretrainCorpus)
    return [corpus.document(i).tolist() for i in range(len(corpus))]


def test_second_prepare_reads_the_cache(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    texts = write_lf_corpus(folder)
    first = CountingTokenizer(demo_tokenizer())
    cold = prepare_data(_cfg(folder), first)
    assert first.texts_tokenized == 65
    second = CountingTokenizer(demo_tokenizer())
    warm = prepare_data(_cfg(folder), second)
    assert second.texts_tokenized == 0
    assert _docs(warm.train) == _docs(cold.train)
    assert warm.stats.to_dict() == cold.stats.to_dict()
    expected = [reference_document(first, t) for t in texts["c4_demo"] + texts["wiki_demo"]]
    assert _docs(warm.train) == expected
    entries = sorted(p.name for p in (tmp_path / "cache" / "pt").iterdir())
    assert len(entries) == 2 and not any(e.startswith(".tmp") for e in entries)


def test_changed_file_tokenizer_or_setting_is_a_new_entry(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    write_lf_corpus(folder)
    prepare_data(_cfg(folder), demo_tokenizer())
    wiki = folder / "wiki_demo.txt"
    wiki.write_text("A new first line.\n" + wiki.read_text())
    changed = CountingTokenizer(demo_tokenizer())
    data = prepare_data(_cfg(folder), changed)
    assert changed.texts_tokenized == 26  # wiki only: c4 comes from the cache
    assert _docs(data.train)[40] == reference_document(changed, "A new first line.")
    stat = wiki.stat()
    os.utime(wiki, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, touched
    touched = CountingTokenizer(demo_tokenizer())
    prepare_data(_cfg(folder), touched)
    assert touched.texts_tokenized == 26
    grown = demo_tokenizer()
    grown.add_tokens(["history"])
    other_tokenizer = CountingTokenizer(grown)
    regrown = prepare_data(_cfg(folder), other_tokenizer)
    assert other_tokenizer.texts_tokenized == 66  # 40 + 26 documents
    assert _docs(regrown.train)[0] == reference_document(grown, _first_c4_text(folder))
    limited = CountingTokenizer(demo_tokenizer())
    prepare_data(_cfg(folder, max_samples=5), limited)
    assert limited.texts_tokenized == 10  # a row limit is a setting of its own entry


def _first_c4_text(folder: Path) -> str:
    import json

    return json.loads((folder / "c4_demo.jsonl").read_text().splitlines()[0])["text"]


def test_a_failed_tokenization_leaves_no_entry_and_keeps_other_files(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    write_lf_corpus(folder)
    cache = tmp_path / "cache"
    (cache / "pt").mkdir(parents=True)
    mine = cache / "pt" / "notes.txt"
    mine.write_text("not the run's file")
    with (folder / "c4_demo.jsonl").open("a") as f:
        f.write("[1, 2]\n")  # a row that is not an object, after 40 good ones
    with pytest.raises(ValueError, match=r"c4_demo.jsonl: row 41 is list"):
        prepare_data(_cfg(folder), demo_tokenizer())
    assert sorted(p.name for p in (cache / "pt").iterdir()) == ["notes.txt"]
    assert mine.read_text() == "not the run's file"


def test_tokenizing_streams_in_bounded_memory(tmp_path: Path, monkeypatch: Any) -> None:
    """A 3 MB corpus tokenized in 16 KiB batches peaks at the size of a batch in Python memory.

    Per batch character: at most one token (byte-level BPE), held as a list entry (8 bytes) and
    an int object (32 bytes; only 0..256 are shared), plus the text: under 50 bytes, so a batch
    peaks below 50 x 16 KiB = 800 KiB; 256 KiB more covers the fixed part (tokenizer
    fingerprint, statistics). Holding the whole corpus takes at least its 3 MB of text, and its
    2.6M token ids as Python ints 20 MB, so the bound fails for any whole-corpus copy."""
    batch_chars = 16 << 10
    monkeypatch.setattr(corpus_module, "BATCH_CHARS", batch_chars)
    rng = random.Random(1)
    path = tmp_path / "big.txt"
    with path.open("w") as f:
        while f.tell() < 3 << 20:
            f.write(random_text(rng, 20, 200) + "\n")
    corpus_bytes = path.stat().st_size
    tokenizer = CountingTokenizer(demo_tokenizer())
    cfg = DataConfig(stage="pt", dataset=str(path), cache_dir=str(tmp_path / "cache"))
    tracemalloc.start()
    try:
        data = prepare_data(cfg, tokenizer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 * batch_chars + (256 << 10) < corpus_bytes / 2, (peak, corpus_bytes)
    assert isinstance(data.train, PretrainCorpus)
    lines = path.read_text().splitlines()
    assert len(data.train) == len(lines) == tokenizer.texts_tokenized
    for i in (0, len(lines) // 2, len(lines) - 1):  # spot checks across batches
        assert data.train.document(i).tolist() == reference_document(tokenizer, lines[i])
    assert isinstance(data.train.token_files[0], np.memmap)  # read back from disk, not held
    assert data.train.num_tokens == int(data.train.doc_len.sum()) == len(data.train.token_files[0])
