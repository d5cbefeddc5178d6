"""Stage pt on LLaMA-Factory-shaped raw text (c4_demo.jsonl, wiki_demo.txt as its dataset_info.json
registers them): documents, token counts, rows cut from the stream, labels, document boundaries
and exact mid-epoch resume, each against the tokenizer's own ids; `packing` is a no-op there, and
documents longer than the model's maximum are tokenized without transformers' warning."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers.utils import logging as transformers_logging

from data_fixtures.helpers import demo_tokenizer, write_rows
from data_fixtures.pt_corpus import reference_document, reference_stream, write_lf_corpus
from megatrain.batch import IGNORE_INDEX
from megatrain.data import DataConfig, make_loader, prepare_data, run_data_command
from megatrain.data.pretrain import PretrainCorpus
from megatrain.data.pretrain_loader import PretrainLoader

SEQ_LEN = 64


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


@pytest.fixture()
def corpus_dir(tmp_path: Path) -> tuple[Path, dict]:
    return tmp_path / "data", write_lf_corpus(tmp_path / "data")


def _cfg(folder: Path, **kw: Any) -> DataConfig:
    base: dict[str, Any] = dict(stage="pt", dataset="c4_demo,wiki_demo", dataset_dir=str(folder))
    base["cache_dir"] = str(folder.parent / "cache")
    return DataConfig(**{**base, **kw})


def _loader(corpus: Any, *, shuffle: bool = False, mbs: int = 3) -> PretrainLoader:
    loader = make_loader(
        corpus, micro_batch_size=mbs, seq_len=SEQ_LEN, packing=False, pad_token_id=0,
        shuffle=shuffle, seed=7,
    )  # fmt: skip
    assert isinstance(loader, PretrainLoader)
    return loader


def test_documents_and_token_counts(tokenizer: Any, corpus_dir: tuple[Path, dict]) -> None:
    folder, texts = corpus_dir
    data = prepare_data(_cfg(folder), tokenizer)
    all_texts = texts["c4_demo"] + texts["wiki_demo"]
    assert isinstance(data.train, PretrainCorpus) and data.eval is None
    assert len(data.train) == len(all_texts) == 65
    for i, text in enumerate(all_texts):
        assert data.train.document(i).tolist() == reference_document(tokenizer, text)
    stream, _ = reference_stream(tokenizer, all_texts)
    stats = data.stats
    assert (stats.rows_read, stats.kept, stats.num_dropped) == (65, 65, 0)
    assert stats.num_tokens == stats.num_target_tokens == data.train.num_tokens == len(stream)


def test_rows_are_the_stream_cut_at_seq_len(tokenizer: Any, corpus_dir: tuple[Path, dict]) -> None:
    folder, texts = corpus_dir
    data = prepare_data(_cfg(folder), tokenizer)
    stream, _ = reference_stream(tokenizer, texts["c4_demo"] + texts["wiki_demo"])
    loader = _loader(data.train)
    rows = len(stream) // SEQ_LEN
    assert loader.num_rows == rows and loader.tokens_dropped == len(stream) - rows * SEQ_LEN
    batches = list(loader)
    assert len(batches) == len(loader) == -(-rows // 3)
    ids = np.concatenate([b.input_ids.numpy() for b in batches])
    assert ids.shape == (rows, SEQ_LEN)
    assert np.array_equal(ids.reshape(-1), stream[: rows * SEQ_LEN])
    for b in batches:  # every token a label; plain causal rows
        assert b.attention_mask is None and b.position_ids is not None
        assert np.array_equal(b.labels.numpy(), b.input_ids.numpy())
        assert np.array_equal(b.position_ids.numpy()[0], np.arange(SEQ_LEN))
    supervised = sum(b.num_target_tokens for b in batches)
    assert supervised == loader.supervised_tokens_per_epoch() == rows * (SEQ_LEN - 1)


def test_neat_packing_restarts_at_document_boundaries(
    tokenizer: Any, corpus_dir: tuple[Path, dict]
) -> None:
    folder, texts = corpus_dir
    data = prepare_data(_cfg(folder, neat_packing=True), tokenizer)
    stream, starts = reference_stream(tokenizer, texts["c4_demo"] + texts["wiki_demo"])
    loader = _loader(data.train)
    batches = list(loader)
    ids = np.concatenate([b.input_ids.numpy() for b in batches]).reshape(-1)
    labels = np.concatenate([b.labels.numpy() for b in batches]).reshape(-1)
    positions = np.concatenate([b.position_ids.numpy() for b in batches]).reshape(-1)  # type: ignore[union-attr]
    n = len(ids)
    assert np.array_equal(ids, stream[:n])
    # reference: a segment starts at every document start and at every row start
    segment_start = np.zeros(n, dtype=bool)
    segment_start[starts[starts < n]] = True
    segment_start[::SEQ_LEN] = True
    last_start = np.maximum.accumulate(np.where(segment_start, np.arange(n), 0))
    assert np.array_equal(positions, np.arange(n) - last_start)
    assert np.array_equal(labels, np.where(segment_start, IGNORE_INDEX, stream[:n]))
    assert (stream[starts[1:] - 1] == tokenizer.eos_token_id).all()  # eos between documents
    inside = int(((starts % SEQ_LEN) != 0).sum() - (starts >= n).sum())
    supervised = sum(b.num_target_tokens for b in batches)
    assert supervised == loader.supervised_tokens_per_epoch() == n - n // SEQ_LEN - inside


def test_mid_epoch_resume_is_exact(tokenizer: Any, corpus_dir: tuple[Path, dict]) -> None:
    folder, _ = corpus_dir
    data = prepare_data(_cfg(folder), tokenizer)
    straight = _loader(data.train, shuffle=True)
    epoch0 = np.concatenate([b.input_ids.numpy() for b in straight])  # one epoch per iter()
    it = iter(straight)
    [next(it) for _ in range(2)]  # into epoch 1
    rows = [straight.row(r)[0] for r in range(straight.num_rows)]
    assert sorted(map(tuple, epoch0.tolist())) == sorted(map(tuple, np.stack(rows).tolist()))
    state = straight.state_dict()
    assert (state["epoch"], state["step"]) == (1, 2)
    rest = [next(it) for _ in range(4)]
    resumed = _loader(prepare_data(_cfg(folder), tokenizer).train, shuffle=True)
    resumed.load_state_dict(state)
    again = iter(resumed)
    for expected in rest:
        got = next(again)
        assert np.array_equal(got.input_ids.numpy(), expected.input_ids.numpy())
        assert np.array_equal(got.labels.numpy(), expected.labels.numpy())
    other = make_loader(
        data.train, micro_batch_size=3, seq_len=SEQ_LEN + 8, packing=False, pad_token_id=0
    )
    with pytest.raises(ValueError, match="seq_len: saved 64, now 72"):
        other.load_state_dict(state)


def test_val_size_splits_whole_documents(tokenizer: Any, corpus_dir: tuple[Path, dict]) -> None:
    folder, texts = corpus_dir
    data = prepare_data(_cfg(folder, val_size=0.2), tokenizer)
    assert isinstance(data.train, PretrainCorpus) and isinstance(data.eval, PretrainCorpus)
    assert (len(data.train), len(data.eval)) == (52, 13)
    every = sorted(
        tuple(c.document(i).tolist()) for c in (data.train, data.eval) for i in range(len(c))
    )
    all_texts = texts["c4_demo"] + texts["wiki_demo"]
    assert every == sorted(tuple(reference_document(tokenizer, t)) for t in all_texts)


@pytest.mark.parametrize("suffix", [".json", ".parquet", ".csv"])
def test_other_file_types_give_the_same_documents(
    tokenizer: Any, tmp_path: Path, corpus_dir: tuple[Path, dict], suffix: str
) -> None:
    folder, texts = corpus_dir
    path = write_rows(tmp_path / f"c4{suffix}", [{"text": t} for t in texts["c4_demo"]])
    direct = prepare_data(_cfg(folder, dataset=str(path)), tokenizer).train
    assert isinstance(direct, PretrainCorpus)
    docs = [direct.document(i).tolist() for i in range(len(direct))]
    assert docs == [reference_document(tokenizer, t) for t in texts["c4_demo"]]


def test_a_folder_of_text_files_and_the_drop_reasons(tokenizer: Any, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "b.txt").write_text("Second file, first line.\n\n   \nSecond file, last line.\n")
    (shards / "a.txt").write_text("First file.\n")
    write_rows(shards / "c.jsonl", [{"text": "Kept."}, {"body": "no text"}, {"text": 7}])
    cfg = DataConfig(stage="pt", dataset=str(shards), cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, tokenizer)
    assert isinstance(data.train, PretrainCorpus)
    texts = ["First file.", "Second file, first line.", "Second file, last line.", "Kept."]
    docs = [data.train.document(i).tolist() for i in range(len(data.train))]
    assert docs == [reference_document(tokenizer, t) for t in texts]
    assert data.stats.rows_read == 8 and data.stats.kept == 4
    assert data.stats.dropped == {"empty_text": 2, "missing_column": 1, "malformed_row": 1}
    limited = prepare_data(DataConfig(**{**cfg.__dict__, "max_samples": 3}), tokenizer)
    assert limited.stats.rows_read == 3 and len(limited.train) == 2


def test_data_command_shows_the_loader_rows(tokenizer: Any, corpus_dir: tuple[Path, dict]) -> None:
    folder, texts = corpus_dir
    cfg = _cfg(folder)
    out = io.StringIO()
    run_data_command(
        cfg, tokenizer, show=4, as_json=True, seq_len=SEQ_LEN, micro_batch_size=3, out=out
    )
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 5
    loader = make_loader(
        prepare_data(cfg, tokenizer).train, micro_batch_size=3, seq_len=SEQ_LEN,
        packing=False, pad_token_id=0, shuffle=cfg.shuffle, seed=cfg.seed,
    )  # fmt: skip
    batches = iter(loader)
    rows = [r for _ in range(2) for r in next(batches).input_ids.tolist()][:4]
    assert [line["input_ids"] for line in lines[:4]] == rows
    assert all(line["labels"] == line["input_ids"] for line in lines[:4])
    stream, _ = reference_stream(tokenizer, texts["c4_demo"] + texts["wiki_demo"])
    n_rows = len(stream) // SEQ_LEN
    summary = lines[4]["summary"]
    assert summary["train"] == {
        "documents": 65, "tokens": len(stream), "supervised_tokens": len(stream)
    }  # fmt: skip
    assert summary["loader"]["rows_per_epoch"] == n_rows
    assert summary["loader"]["supervised_tokens_per_epoch"] == n_rows * (SEQ_LEN - 1)
    assert summary["loader"]["tokens_dropped"] == len(stream) - n_rows * SEQ_LEN


def test_packing_is_a_no_op_under_pt(tokenizer: Any, corpus_dir: tuple[Path, dict]) -> None:
    folder, _ = corpus_dir
    outputs = []
    for packing in (True, False):
        cfg = _cfg(folder, packing=packing)
        cfg.validate()  # an sft config's packing: true is accepted
        assert cfg.layout() == "full"
        out = io.StringIO()
        run_data_command(
            cfg, tokenizer, show=3, as_json=True, seq_len=SEQ_LEN, micro_batch_size=2, out=out
        )
        outputs.append(out.getvalue())
    assert outputs[0] == outputs[1]


@pytest.fixture()
def transformers_warnings() -> Iterator[None]:
    """transformers' warnings reach pytest's caplog (the suite runs it at verbosity error)."""
    previous = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_warning()
    transformers_logging.enable_propagation()
    try:
        yield
    finally:
        transformers_logging.disable_propagation()
        transformers_logging.set_verbosity(previous)


@pytest.mark.parametrize("stage", ["pt", "sft"])
def test_documents_longer_than_the_model_maximum_do_not_warn(
    stage: str,
    corpus_dir: tuple[Path, dict],
    tmp_path: Path,
    transformers_warnings: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder, texts = corpus_dir
    warning = "Token indices sequence length is longer than the specified maximum"
    seen = demo_tokenizer()
    seen.model_max_length = 8
    seen(texts["wiki_demo"][0])  # called directly, the tokenizer warns (once per tokenizer)
    assert warning in caplog.text
    caplog.clear()
    short = demo_tokenizer()
    short.model_max_length = 8  # every document and conversation is longer
    if stage == "pt":
        cfg = _cfg(folder)
    else:
        rows = [{"instruction": t, "output": t} for t in texts["c4_demo"][:4]]
        cfg = DataConfig(dataset=str(write_rows(tmp_path / "long.jsonl", rows)))
    data = prepare_data(cfg, short)
    assert len(data.train) > 0 and warning not in caplog.text
