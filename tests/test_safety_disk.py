"""Disk: the run's bytes as arithmetic, a run the disk cannot hold refused before the model loads,
ENOSPC during a save leaves no temporary folder and the previous checkpoint intact, and
checkpoint.save_final: false writes only the Hugging Face export."""

from __future__ import annotations

import errno
import json
import re
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from megatrain import disk_space
from megatrain.checkpoint import export as export_mod
from megatrain.checkpoint import saving as ckpt_mod
from megatrain.checkpoint.saving import latest_checkpoint, list_checkpoints
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.disk_space import DiskFullError
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.planning.disk import run_disk_bytes
from megatrain.recipes.sft import Trainer
from megatrain.store.host import HostStore

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
SMALL = (
    "{vocab_size: 512, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, tie_word_embeddings: true}"
)
_Usage = namedtuple("_Usage", "total used free")


def _args(out: Path, *overrides: str) -> list[str]:
    return [
        "--training.output_dir", str(out), "--logging.progress_bar", "false",
        "--logging.report_to", "none", "--model.config_overrides", SMALL,
        "--data.val_size", "0", "--training.micro_batch_size", "2", *overrides,
    ]  # fmt: skip


def test_run_bytes_of_an_8b_model() -> None:
    n = 8_030_261_248  # Llama-3.1-8B
    metrics = 2048 * 1000
    small = 64 * 2**20
    # save_every 0: one final checkpoint (12 B/param), then the bf16 export beside it
    one = run_disk_bytes(
        n, save_every=0, save_final=True, keep_last=2, export_hf=True, export_dtype="bf16",
        total_steps=1000,
    )  # fmt: skip
    assert one.peak_bytes == 12 * n + 2 * n + metrics + small
    # save_every 100 over 1000 steps, keep_last 2: three exist while the third is written
    many = run_disk_bytes(
        n, save_every=100, save_final=True, keep_last=2, export_hf=True, export_dtype="fp32",
        total_steps=1000,
    )  # fmt: skip
    assert (many.checkpoints_at_peak, many.checkpoints_kept) == (3, 2)
    assert many.peak_bytes == max(3 * 12 * n, 2 * 12 * n + 4 * n) + metrics + small
    # only the export: no resumable checkpoint needs disk
    export_only = run_disk_bytes(
        n, save_every=0, save_final=False, keep_last=2, export_hf=True, export_dtype="bf16",
        total_steps=1000,
    )  # fmt: skip
    assert export_only.peak_bytes == 2 * n + metrics + small
    assert export_only.describe().startswith(f"the Hugging Face export of {2 * n / 2**30:.2f} GiB;")


def test_run_the_disk_cannot_hold_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        disk_space.shutil, "disk_usage", lambda p: _Usage(2**30, 2**30 - 2**20, 2**20)
    )
    code = main(["train", "--config", str(DEMO), *_args(tmp_path, "--training.max_steps", "1")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"training.output_dir={str(tmp_path)!r} is on a filesystem with 0.00 GiB free" in err
    assert "checkpoint.save_final: false" in err and "checkpoint.keep_last" in err
    assert not (tmp_path / "checkpoints").exists()


def test_disk_full_during_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(DEMO, _args(tmp_path, "--training.max_steps", "1", "--checkpoint.export_hf",
                                  "false", "--checkpoint.keep_last", "3"))  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.train()
        good = latest_checkpoint(tmp_path)
        assert good is not None
        before = {p.name: p.read_bytes() for p in (good / "blocks").iterdir()}
        real_save, calls = ckpt_mod.save_file, []

        def fills_the_disk(tensors: object, path: str, metadata: object = None) -> None:
            calls.append(path)
            if len(calls) == 2:  # midway: a partial file, then ENOSPC
                Path(path).write_bytes(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device", path)
            real_save(tensors, path, metadata=metadata)  # type: ignore[arg-type]

        monkeypatch.setattr(ckpt_mod, "save_file", fills_the_disk)
        trainer.step = 2
        with pytest.raises(DiskFullError) as caught:
            trainer.save()
    finally:
        trainer.close()
    message = str(caught.value)
    assert f"checkpoint step 2 into {tmp_path / 'checkpoints'}" in message
    assert "GiB" in message and "resume_from auto" in message
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]
    assert {p.name: p.read_bytes() for p in (good / "blocks").iterdir()} == before


def test_safetensors_disk_full_text_is_recognised(tmp_path: Path) -> None:
    # the Rust writer reports ENOSPC as text, not as an OSError
    assert disk_space.is_disk_full(RuntimeError("No space left on device (os error 28)"))
    assert not disk_space.is_disk_full(OSError(errno.EACCES, "Permission denied"))


def test_save_final_false_writes_only_the_export(tmp_path: Path) -> None:
    cfg = load_config(DEMO, _args(tmp_path, "--training.max_steps", "2",
                                  "--checkpoint.save_final", "false"))  # fmt: skip
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary.checkpoint is None and list_checkpoints(tmp_path) == []
    assert summary.export_dir is not None and (summary.export_dir / "model.safetensors").is_file()


def test_saving_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="would save nothing"):
        load_config(DEMO, ["--checkpoint.save_final", "false", "--checkpoint.export_hf", "false"])


def test_free_bytes_of_a_folder_not_yet_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Path] = []
    monkeypatch.setattr(
        disk_space.shutil, "disk_usage", lambda p: asked.append(p) or _Usage(9, 2, 7)
    )
    assert disk_space.free_bytes(tmp_path / "a" / "b") == 7
    assert asked == [tmp_path.resolve()]


def test_estimate_reports_checkpoint_and_export_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model-type", "llama", "--tiny", "--seq-len", "64", "--json"]) == 0
    params = json.loads(capsys.readouterr().out)["total_params"]
    assert main(["estimate", "--model-type", "llama", "--tiny", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    ckpt = f"{12 * params / 2**30:.2f}"
    export = f"{2 * params / 2**30:.2f}"
    assert re.search(rf"one checkpoint \(fp32 master \+ Adam m, v\) +{re.escape(ckpt)} ", out)
    assert re.search(rf"Hugging Face export \(bf16\) +{re.escape(export)}$", out, re.M)


def test_disk_full_during_export_removes_the_partial_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_causal_lm(None, model_type="llama", tiny=True)
    store = HostStore(discover(model), compute_dtype=torch.float32)

    def full(self: object, folder: str, **kwargs: object) -> None:
        Path(folder).mkdir()
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(type(model), "save_pretrained", full)
    with pytest.raises(DiskFullError, match=f"the Hugging Face export hf into {tmp_path}"):
        export_mod.export_hf(store, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
