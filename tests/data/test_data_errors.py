"""User-facing data errors: each names the file, key or value and the fix, and the CLI prints it
as one paragraph without a traceback. Stage mismatches (SFT data given to pt, raw text given to
sft) say which stage the data looks like."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from data_fixtures.helpers import demo_tokenizer, write_rows
from data_fixtures.pt_corpus import write_lf_corpus
from megatrain.cli import build_parser, main
from megatrain.data import DataConfig, prepare_data

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(["data", "--config", str(DEMO), *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return status, captured.err


def test_all_rows_dropped_blames_the_drops_not_val_size(tokenizer: Any, tmp_path: Path) -> None:
    path = write_rows(tmp_path / "a.jsonl", [{"instruction": "hi", "output": ""}] * 4)
    for val_size in (0, 0.1, 2):
        cfg = DataConfig(dataset=str(path), val_size=val_size)
        with pytest.raises(ValueError) as err:
            prepare_data(cfg, tokenizer)
        message = str(err.value)
        assert "no training sample is left" in message and "empty_content=4" in message
        assert "val_size" not in message


def test_invalid_json_reports_the_real_location(tokenizer: Any, tmp_path: Path) -> None:
    text = '[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c" "output": "d"}\n]\n'
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(text)
    where = f"line {ref.value.lineno} column {ref.value.colno}"
    assert where == "line 3 column 23"
    with pytest.raises(ValueError, match=f"broken.json: invalid JSON at {where}: Expecting ','"):
        prepare_data(DataConfig(dataset=str(path)), tokenizer)
    lines = tmp_path / "lines.json"  # JSON lines under a .json name, bad on line 3
    lines.write_text('{"instruction": "a", "output": "b"}\n' * 2 + '{"instruction": \n')
    with pytest.raises(ValueError, match=r"lines.json: invalid JSON at line 3 column"):
        prepare_data(DataConfig(dataset=str(lines)), tokenizer)


def test_show_must_not_be_negative_and_help_says_rows(capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _cli(capsys, "--show", "-1", "--data.max_samples", "20")
    assert status == 2
    assert "megatrain data: error: --show -1: the number of rows to print must be 0" in err
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    help_text = sub.choices["data"].format_help()  # type: ignore[attr-defined]
    assert "rows to print" in help_text and "one JSON object per row" in help_text
    assert "samples to print" not in help_text


def test_unknown_dataset_dir_reads_clearly(
    tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"data.dataset_dir='{missing}': no such folder"):
        prepare_data(DataConfig(dataset="alpaca_en_demo", dataset_dir=str(missing)), tokenizer)
    status, err = _cli(capsys, "--data.dataset_dir", str(missing))
    assert status == 2 and "no such folder" in err and "not in no" not in err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError) as info:
        prepare_data(DataConfig(dataset="alpaca_en_demo", dataset_dir=str(empty)), tokenizer)
    message = str(info.value)
    assert f"the folder {empty} has no dataset_info.json" in message
    assert "not in no" not in message


def test_raw_text_given_to_sft_says_it_looks_like_pt(tokenizer: Any, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    write_lf_corpus(folder)
    # registered as LLaMA-Factory registers them
    with pytest.raises(ValueError, match=r"data set 'c4_demo'.*set data.stage: pt"):
        prepare_data(DataConfig(dataset="c4_demo", dataset_dir=str(folder)), tokenizer)
    txt = r"wiki_demo.txt: a .txt file is raw text \(one document per line\).*set data.stage: pt"
    with pytest.raises(ValueError, match=txt):
        prepare_data(DataConfig(dataset="wiki_demo", dataset_dir=str(folder)), tokenizer)
    with pytest.raises(ValueError, match=txt):
        prepare_data(DataConfig(dataset=str(folder / "wiki_demo.txt")), tokenizer)
    rows = write_rows(tmp_path / "text.jsonl", [{"text": "Plain text."}])
    with pytest.raises(ValueError, match=r"looks like pre-training data; set data.stage: pt"):
        prepare_data(DataConfig(dataset=str(rows)), tokenizer)
    (folder / "README.txt").write_text("not data\n")  # a .txt beside sft files is skipped
    write_rows(folder / "sft" / "a.jsonl", [{"instruction": "Hi", "output": "Yo"}])
    (folder / "sft" / "README.txt").write_text("not data\n")
    data = prepare_data(DataConfig(dataset=str(folder / "sft")), tokenizer)
    assert data.stats.rows_read == 1


def test_sft_data_given_to_pt_says_it_looks_like_sft(tokenizer: Any, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError, match=r"formatting 'sharegpt'.*set data.stage: sft"):
        prepare_data(DataConfig(stage="pt", dataset="demo", cache_dir=cache), tokenizer)
    alpaca = write_rows(tmp_path / "a.jsonl", [{"instruction": "hi", "output": "yo"}])
    with pytest.raises(ValueError, match=r"rows are alpaca conversations.*set data.stage: sft"):
        prepare_data(DataConfig(stage="pt", dataset=str(alpaca), cache_dir=cache), tokenizer)
    assert not list((tmp_path / "cache" / "pt").iterdir())  # nothing half-written is left
    other = write_rows(tmp_path / "b.jsonl", [{"body": "text"}])
    with pytest.raises(ValueError, match=r"no text column 'text' \(keys \['body'\]\)"):
        prepare_data(DataConfig(stage="pt", dataset=str(other), cache_dir=cache), tokenizer)


@pytest.mark.parametrize(
    ("key", "value"), [("train_on_prompt", True), ("overflow", "drop"), ("system_prompt", "x")]
)
def test_pt_refuses_conversation_options(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"data.{key}=.*does not apply to data.stage: pt"):
        DataConfig(stage="pt", **{key: value}).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"data.neat_packing=True applies to data.stage: pt"):
        DataConfig(neat_packing=True).validate()
    stages = r"\['sft', 'pt', 'dpo', 'kto'\]"
    with pytest.raises(ValueError, match=rf"data.stage='cpt' must be one of {stages}"):
        DataConfig(stage="cpt").validate()


def test_rows_too_long_for_cutoff_len_say_so_once(tokenizer: Any) -> None:
    for overflow, extra in (("truncate", ""), ("drop", ", or set data.overflow: truncate")):
        cfg = DataConfig(dataset="demo", cutoff_len=10, overflow=overflow, max_samples=20)
        with pytest.raises(ValueError) as err:
            prepare_data(cfg, tokenizer)
        assert str(err.value) == (
            "no training sample is left from data.dataset='demo': all 20 rows were dropped "
            "(over_cutoff_len=20); raise data.cutoff_len (the warning above gives the length "
            f"that keeps them){extra}"
        )


def test_an_empty_text_file_is_called_empty(tokenizer: Any, tmp_path: Path) -> None:
    empty = tmp_path / "corpus.txt"
    empty.write_text("")
    with pytest.raises(ValueError) as err:
        prepare_data(DataConfig(dataset=str(empty), stage="pt"), tokenizer)
    assert str(err.value) == (
        f"no document is left from data.dataset='{empty}': the data is empty ({empty} holds no "
        "rows); point data.dataset at the data"
    )


def test_a_control_character_in_a_json_string_is_said_whole(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "tabs.jsonl"
    path.write_text('{"instruction": "a\tb", "output": "c"}\n')
    with pytest.raises(ValueError) as err:
        prepare_data(DataConfig(dataset=str(path)), tokenizer)
    assert str(err.value) == (
        f"{path}: invalid JSON at line 1 column 19: a control character (a tab or line break) "
        "inside a string; write it as \\t or \\n"
    )


def test_rows_are_numbered_from_1_and_the_first_drop_is_located(
    tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = {"instruction": "hi", "output": "there"}
    path = write_rows(tmp_path / "a.jsonl", [good, good, {"instruction": "hi", "output": ""}])
    prepare_data(DataConfig(dataset=str(path), val_size=0), tokenizer)
    assert "first dropped: row 3 (empty_content)" in caplog.text
    (tmp_path / "b.json").write_text(json.dumps([good, "not an object"]))
    with pytest.raises(ValueError, match=r"b\.json: row 2 is str, expected a JSON object"):
        prepare_data(DataConfig(dataset=str(tmp_path / "b.json")), tokenizer)
