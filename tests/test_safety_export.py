"""`export_hf` / `megatrain export --out DIR` never deletes what it did not write: a non-empty
folder that is not a previous export is refused, a previous export is replaced by an atomic swap
that removes only the files that export listed, and --overwrite keeps every foreign file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain.checkpoint.export import export_hf
from megatrain.checkpoint.saving import save_checkpoint
from megatrain.cli import main
from megatrain.config import load_config, save_config
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.run_files import EXPORT_MARKER
from megatrain.store.host import HostStore

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64}


def _store(seed: int) -> HostStore:
    model = load_causal_lm(None, model_type="llama", tiny=True, config_overrides=SMALL, seed=seed)
    return HostStore(discover(model), compute_dtype=torch.float32)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_non_empty_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.pdf").write_bytes(b"years of work")
    with pytest.raises(ValueError, match=f"--out {out} is not empty.*{EXPORT_MARKER}"):
        export_hf(_store(0), out)
    assert [p.name for p in out.iterdir()] == ["thesis.pdf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_previous_export_is_replaced_keeping_foreign_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = export_hf(_store(0), out, dtype="fp32")
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert "model.safetensors" in marker["files"] and "config.json" in marker["files"]
    # a file the first export listed but the second does not write, and a file of the user's
    (out / "stale.bin").write_bytes(b"x")
    marker["files"].append("stale.bin")
    (out / EXPORT_MARKER).write_text(json.dumps(marker))
    (out / "README.md").write_text("my notes")
    second_store = _store(1)
    export_hf(second_store, first, dtype="fp32")
    assert not (out / "stale.bin").exists()
    assert (out / "README.md").read_text() == "my notes"
    with second_store.bound(torch.float32) as model:
        expected = {n: p.detach() for n, p in model.named_parameters()}
    got = _weights(out)
    assert got.keys() <= expected.keys() and len(got) > 0
    assert all(torch.equal(got[n], expected[n]) for n in got)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_writes_into_a_foreign_folder_and_keeps_its_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.pdf").write_bytes(b"years of work")
    (out / "config.json").write_text("{}")  # clashes with the export's config.json
    export_hf(_store(0), out, overwrite=True)
    assert (out / "thesis.pdf").read_bytes() == b"years of work"
    assert (out / EXPORT_MARKER).is_file() and (out / "model.safetensors").is_file()
    (kept,) = tmp_path.glob("out.kept-*")
    assert [p.name for p in kept.iterdir()] == ["config.json"]
    assert (kept / "config.json").read_text() == "{}"


def test_cli_export_refuses_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = load_config(DEMO, ["--model.config_overrides", json.dumps({**SMALL, "vocab_size": 512})])
    store = HostStore(
        discover(
            load_causal_lm(
                None,
                model_type="llama",
                tiny=True,
                config_overrides=dict(cfg.model.config_overrides),
            )
        ),
        compute_dtype=torch.float32,
    )
    ckpt = save_checkpoint(
        tmp_path / "run", 1, store, {}, keep_last=1, run_id="r",
        write_extra=lambda d: save_config(cfg, d / "config.yaml"),
    )  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.csv").write_text("1,2")
    code = main(["export", "--checkpoint", str(ckpt), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"--out {out} is not empty" in err
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    assert (out / "data.csv").read_text() == "1,2" and (out / EXPORT_MARKER).is_file()


def test_export_and_a_quiet_load_show_no_transformers_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    export_hf(_store(0), tmp_path / "out")
    assert "Writing model shards" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # restored for the rest of the process
    load_causal_lm(str(tmp_path / "out"), progress_bar=False)  # logging.progress_bar: false
    assert "Loading weights" not in capsys.readouterr().err
    load_causal_lm(str(tmp_path / "out"))
    assert "Loading weights" in capsys.readouterr().err  # the bar this test would catch
