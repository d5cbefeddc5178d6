"""Errors of tokenizer and model loading are one paragraph naming the key, the value and the fix,
never a traceback (unless MEGATRAIN_DEBUG=1). The hub is offline in tests (conftest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.cli import main

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
HUB_ID = "megatrain-tests/no-such-model"


def _run(
    capsys: pytest.CaptureFixture[str], command: str, tmp: Path, *overrides: str
) -> tuple[int, str]:
    code = main(
        [command, "--config", str(DEMO), "--training.output_dir", str(tmp / "run"), *overrides]
    )
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "data"])
def test_missing_tokenizer_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    missing = tmp_path / "no" / "tokenizer"
    code, err = _run(capsys, command, tmp_path, "--model.tokenizer", str(missing))
    assert code == 2 and "Traceback" not in err
    assert f"model.tokenizer='{missing}': no such folder" in err
    assert "Repo id" not in err


def test_tokenizer_folder_without_tokenizer_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "tok"
    empty.mkdir()
    code, err = _run(capsys, "data", tmp_path, "--model.tokenizer", str(empty))
    assert code == 2 and "Traceback" not in err
    assert f"model.tokenizer='{empty}' holds no tokenizer files" in err
    assert "sentencepiece" not in err


@pytest.mark.parametrize("command", ["train", "data"])
def test_hub_id_while_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    model = ("--model.model_type", "null", "--model.tiny", "false", "--model.tokenizer", "null")
    code, err = _run(capsys, command, tmp_path, *model, "--model.name_or_path", HUB_ID)
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert f"model.name_or_path='{HUB_ID}': cannot load the tokenizer" in err
    assert "HF_HUB_OFFLINE" in err and "local folder" in err


def test_hub_model_config_while_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the tokenizer is local, so the model config is the first thing fetched from the hub
    model = ("--model.model_type", "null", "--model.tiny", "false", "--model.tokenizer", "demo")
    code, err = _run(capsys, "train", tmp_path, *model, "--model.name_or_path", HUB_ID,
                     "--data.max_samples", "50", "--data.val_size", "0")  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert f"model.name_or_path='{HUB_ID}': cannot load the model config" in err


def test_debug_variable_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        main(["data", "--config", str(DEMO), "--model.tokenizer", str(tmp_path / "missing")])
