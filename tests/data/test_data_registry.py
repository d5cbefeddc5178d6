"""Registry and readers: dataset_info.json entries, paths with detected formats, every file type,
folders, num_samples/max_samples, and the hub path through a monkeypatched snapshot_download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest

from data_fixtures.helpers import demo_tokenizer, write_rows
from megatrain.data import DataConfig, Sample, prepare_data, resolve_datasets

ALPACA_ROWS = [
    {"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"},
    {"instruction": "Sort the letters.", "input": "c a b", "output": "a b c"},
    {"instruction": "Count the letters.", "input": "a b", "output": "2"},
]
OPENAI_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"{r['instruction']}\n{r['input']}"},
            {"role": "assistant", "content": r["output"]},
        ]
    }
    for r in ALPACA_ROWS
]
SHAREGPT_ROWS = [
    {
        "conversations": [
            {"from": "human", "value": m["messages"][0]["content"]},
            {"from": "gpt", "value": m["messages"][1]["content"]},
        ]
    }
    for m in OPENAI_ROWS
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


def _ids(samples: list[Sample]) -> list[tuple[list[int], list[bool]]]:
    return [(s.input_ids.tolist(), s.target_mask.tolist()) for s in samples]


def _prepare(tokenizer: Any, **kwargs: Any) -> list[Sample]:
    return prepare_data(DataConfig(shuffle=False, **kwargs), tokenizer).train


@pytest.fixture(scope="module")
def reference(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> list:
    path = write_rows(tmp_path_factory.mktemp("ref") / "ref.jsonl", OPENAI_ROWS)
    return _ids(_prepare(tokenizer, dataset=str(path)))


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet", ".csv"])
@pytest.mark.parametrize(
    "rows", [ALPACA_ROWS, OPENAI_ROWS, SHAREGPT_ROWS], ids=["alp", "oai", "sg"]
)
def test_every_file_type_and_format_by_path(
    tmp_path: Path, tokenizer: Any, reference: list, suffix: str, rows: list
) -> None:
    if suffix == ".csv" and rows is not ALPACA_ROWS:  # csv holds turns as JSON text
        rows = [{k: json.dumps(v) for k, v in r.items()} for r in rows]
    path = write_rows(tmp_path / f"data{suffix}", rows)
    assert _ids(_prepare(tokenizer, dataset=str(path))) == reference


def test_json_file_holding_json_lines(tmp_path: Path, tokenizer: Any, reference: list) -> None:
    path = tmp_path / "lines.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in OPENAI_ROWS))
    assert _ids(_prepare(tokenizer, dataset=str(path))) == reference


def test_folder_reads_all_files_in_sorted_order(tmp_path: Path, tokenizer: Any, reference) -> None:
    write_rows(tmp_path / "d" / "b" / "part.parquet", OPENAI_ROWS[1:])
    write_rows(tmp_path / "d" / "a.jsonl", OPENAI_ROWS[:1])
    (tmp_path / "d" / "README.md").write_text("ignored")
    assert _ids(_prepare(tokenizer, dataset=str(tmp_path / "d"))) == reference


def test_registry_by_name_with_renamed_columns_and_relative_file(
    tmp_path: Path, tokenizer: Any, reference: list
) -> None:
    renamed = [{"q": r["instruction"], "x": r["input"], "a": r["output"]} for r in ALPACA_ROWS]
    write_rows(tmp_path / "sub" / "mine.json", renamed)
    info = {
        "mine": {
            "file_name": "sub/mine.json",
            "columns": {"prompt": "q", "query": "x", "response": "a"},
        },
        "chat": {
            "file_name": "chat.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "m"},
            "tags": {"role_tag": "r", "content_tag": "c", "user_tag": "u", "assistant_tag": "b"},
        },
    }
    chat = [
        {
            "m": [
                {"r": "u", "c": t["messages"][0]["content"]},
                {"r": "b", "c": t["messages"][1]["content"]},
            ]
        }
        for t in OPENAI_ROWS
    ]
    write_rows(tmp_path / "chat.jsonl", chat)
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    assert _ids(_prepare(tokenizer, dataset="mine", dataset_dir=str(tmp_path))) == reference
    both = _prepare(tokenizer, dataset="mine,chat", dataset_dir=str(tmp_path))
    assert _ids(both) == reference + reference


def test_unknown_name_lists_registry_and_file(tmp_path: Path) -> None:
    (tmp_path / "dataset_info.json").write_text(json.dumps({"one": {"file_name": "1.json"}}))
    with pytest.raises(ValueError) as err:
        resolve_datasets(["two"], tmp_path)
    assert "unknown data set 'two'" in str(err.value)
    assert f"{tmp_path / 'dataset_info.json'}, which registers ['one']" in str(err.value)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"ms_hub_url": "org/x"}, "its only source is ms_hub_url='org/x', which megatrain"),
        ({"script_url": "s", "xx_hub_url": "o/x"}, "only source is script_url='s', xx_hub_url="),
        ({"file_name": "x.json", "columns": {"chosen": "c"}}, """add "ranking": true"""),
        ({"file_name": "x.json", "ranking": "yes"}, "ranking='yes' must be true or false"),
        (
            {"file_name": "x.json", "ranking": True, "columns": {"kto_tag": "l"}},
            "columns.kto_tag (KTO, one labelled completion per row) and ranking: true",
        ),
        (
            {"file_name": "x.json", "ranking": True, "columns": {"images": "i"}},
            "multimodal data (columns.images)",
        ),
        ({"file_name": "x.json", "file": "y.json"}, "unsupported keys ['file']"),
        ({"file_name": "x.json", "formatting": "xml"}, "formatting='xml'"),
        ({"file_name": "x.json", "num_samples": 0}, "num_samples=0"),
        ({"formatting": "alpaca"}, "needs file_name or hf_hub_url"),
    ],
)
def test_registry_rejects_what_it_cannot_honour(tmp_path: Path, entry: dict, message: str) -> None:
    (tmp_path / "dataset_info.json").write_text(json.dumps({"bad": entry}))
    with pytest.raises(ValueError) as err:
        resolve_datasets(["bad"], tmp_path)
    assert "data set 'bad'" in str(err.value) and message in str(err.value)


def test_other_sources_beside_a_file_or_hf_hub_url_are_ignored(tmp_path: Path) -> None:
    others = {"ms_hub_url": "o/x", "om_hub_url": "o/x", "script_url": "s", "cloud_file_name": "c"}
    info = {"local": {"file_name": "x.json", **others}, "hub": {"hf_hub_url": "o/x", **others}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    local, hub = resolve_datasets(["local", "hub"], tmp_path)
    assert (local.load_from, local.path) == ("file", str(tmp_path / "x.json"))
    assert (hub.load_from, hub.path) == ("hf_hub", "o/x")


def test_undetectable_format_names_the_file_and_keys(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as err:
        resolve_datasets([str(path)], tmp_path)
    assert str(path) in str(err.value) and "['answer', 'question']" in str(err.value)


def test_num_samples_and_max_samples(tmp_path: Path, tokenizer: Any) -> None:
    write_rows(tmp_path / "d.jsonl", OPENAI_ROWS)
    info = {
        "few": {"file_name": "d.jsonl", "formatting": "openai", "num_samples": 2},
        "many": {"file_name": "d.jsonl", "formatting": "openai", "num_samples": 7},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    few = _ids(_prepare(tokenizer, dataset="few", dataset_dir=str(tmp_path)))
    many = _ids(_prepare(tokenizer, dataset="many", dataset_dir=str(tmp_path)))
    full = _ids(_prepare(tokenizer, dataset=str(tmp_path / "d.jsonl")))
    assert len(few) == 2 and len({str(x) for x in few}) == 2 and all(x in full for x in few)
    assert len(many) == 7 and all(x in many for x in full)
    capped = _prepare(tokenizer, dataset="many", dataset_dir=str(tmp_path), max_samples=4)
    assert _ids(capped) == many[:4]


def test_hf_hub_url_through_snapshot_download(
    tmp_path: Path, tokenizer: Any, reference: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "snapshot"
    write_rows(repo / "main" / "train-00000-of-00002.parquet", OPENAI_ROWS[:2])
    write_rows(repo / "main" / "train-00001-of-00002.parquet", OPENAI_ROWS[2:])
    write_rows(repo / "main" / "test-00000-of-00001.parquet", OPENAI_ROWS[:1])
    write_rows(repo / "other" / "train.jsonl", OPENAI_ROWS[1:2])
    calls: list[dict] = []

    def fake_snapshot_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        return str(repo)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    entry = {"hf_hub_url": "org/chat", "formatting": "openai", "revision": "v1"}
    info = {
        "main": {**entry, "subset": "main"},
        "main_test": {**entry, "subset": "main", "split": "test"},
        "other": {**entry, "folder": "other"},
        "no_subset": entry,
        "no_split": {**entry, "subset": "main", "split": "dev"},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))

    def ids(name: str) -> list:
        return _ids(_prepare(tokenizer, dataset=name, dataset_dir=str(tmp_path)))

    assert ids("main") == reference
    assert ids("main_test") == reference[:1]
    assert ids("other") == reference[1:2]
    assert calls[0]["repo_id"] == "org/chat" and calls[0]["repo_type"] == "dataset"
    assert calls[0]["revision"] == "v1"
    assert "main/*.parquet" in calls[0]["allow_patterns"]
    assert "other/*.jsonl" in calls[2]["allow_patterns"]
    with pytest.raises(ValueError, match=r"several folders \['main', 'other'\]"):
        ids("no_subset")
    with pytest.raises(FileNotFoundError, match="no data file of split 'dev'"):
        ids("no_split")


def test_hub_repository_without_split_names_is_all_train(
    tmp_path: Path, tokenizer: Any, reference: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_rows(tmp_path / "snapshot" / "rows.jsonl", OPENAI_ROWS)
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda **kw: str(tmp_path / "snapshot")
    )
    info = {"hub": {"hf_hub_url": "org/rows", "formatting": "openai"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    assert _ids(_prepare(tokenizer, dataset="hub", dataset_dir=str(tmp_path))) == reference
