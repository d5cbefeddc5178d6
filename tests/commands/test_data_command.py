"""`megatrain data --show N [--json]`: the printed rows are the loader's rows, the summary its
numbers."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from data_fixtures.helpers import demo_tokenizer
from megatrain.data import DataConfig, make_loader, prepare_data, run_data_command


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


def _run(cfg: DataConfig, tokenizer: Any, *, show: int, as_json: bool) -> str:
    out = io.StringIO()
    status = run_data_command(
        cfg, tokenizer, show=show, as_json=as_json, seq_len=96, micro_batch_size=2, out=out
    )
    assert status == 0
    return out.getvalue()


@pytest.mark.parametrize("packing", [False, True])
def test_json_rows_are_the_loader_rows(tokenizer: Any, packing: bool) -> None:
    cfg = DataConfig(max_samples=200, packing=packing, val_size=20)
    lines = _run(cfg, tokenizer, show=5, as_json=True).splitlines()
    assert len(lines) == 6
    rows = [json.loads(line) for line in lines[:5]]
    summary = json.loads(lines[5])["summary"]
    data = prepare_data(cfg, tokenizer)
    loader = make_loader(
        data.train,
        micro_batch_size=2,
        seq_len=96,
        packing=packing,
        pad_token_id=data.pad_token_id,
        seed=cfg.seed,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
    )
    expected = []
    for batch in loader:
        for r in range(batch.input_ids.shape[0]):
            mask = batch.attention_mask
            expected.append(
                {
                    "input_ids": batch.input_ids[r].tolist(),
                    "labels": batch.labels[r].tolist(),
                    "position_ids": batch.position_ids[r].tolist(),  # type: ignore[index]
                    "attention_mask": None if mask is None else mask[r].tolist(),
                }
            )
        if len(expected) >= 5:
            break
    assert rows == expected[:5]
    assert all(len(r["input_ids"]) == 96 for r in rows) == packing
    assert summary["train"] == {
        "samples": 180,
        "tokens": sum(s.num_tokens for s in data.train),
        "supervised_tokens": sum(s.num_target_tokens for s in data.train),
    }
    assert summary["eval"]["samples"] == 20
    assert summary["preparation"] == data.stats.to_dict()
    assert summary["preparation"]["rows_read"] == 200
    assert summary["loader"]["micro_batches_per_epoch"] == len(loader)


def test_human_form_marks_supervised_spans(tokenizer: Any) -> None:
    # the first demo samples have 21, 21 and 31 tokens: the third is over cutoff_len
    cfg = DataConfig(max_samples=3, shuffle=False, cutoff_len=24, overflow="drop")
    text = _run(cfg, tokenizer, show=1, as_json=False)
    first = prepare_data(cfg, tokenizer).train[0]
    assert first.num_tokens == 21
    reply = tokenizer.decode(first.input_ids[first.target_mask].tolist())
    assert reply == "b b a<|im_end|>\n"
    assert "assistant\n[[b b a<|im_end|>\n]]\n<pad x 3>\n" in text  # padded to a multiple of 8
    assert text.startswith("=== row 0: 24 tokens, 1 segment(s) ===\n")  # the padding is none
    assert text.endswith("marks: [[ ]] around the supervised tokens (the loss is taken on them; "
                         "the rest is context), <pad x N> for padding (neither attended to nor "
                         "supervised)\n")  # fmt: skip
    assert text.count("[[") == 2 and text.count("]]") == 2  # the reply, and the legend
    assert "preparation: 3 rows read, 2 kept, 1 dropped (over_cutoff_len=1), 0 truncated" in text
    assert "train: 2 samples, 42 tokens, 10 supervised tokens" in text
