"""Shared helpers of the data-pipeline tests (tests/test_data_*.py): the demo tokenizer, writers
for every supported file type, and the supervised runs of a sample."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from megatrain.data import Sample
from megatrain.package_assets import demo_tokenizer_dir


def demo_tokenizer() -> Any:
    """A fresh copy each call: some tests add tokens or change the template."""
    return AutoTokenizer.from_pretrained(str(demo_tokenizer_dir()))


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write `rows` in the format of `path`'s suffix (.json, .jsonl, .parquet, .csv)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        raise AssertionError(path)
    return path


def supervised_runs(sample: Sample) -> list[list[int]]:
    """The token ids of each maximal run of supervised positions, in order."""
    runs: list[list[int]] = []
    previous = False
    for token, supervised in zip(
        sample.input_ids.tolist(), sample.target_mask.tolist(), strict=True
    ):
        if supervised and not previous:
            runs.append([])
        if supervised:
            runs[-1].append(token)
        previous = supervised
    return runs


def make_sample(ids: list[int], mask: list[bool]) -> Sample:
    return Sample(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.bool_))
