"""A run never deletes what another run wrote: a non-empty output_dir is refused (or, with
training.overwrite_output_dir, the previous run is moved aside), and checkpoint pruning touches
only the checkpoints of the saving run's lineage. A start that fails does not claim the folder:
the corrected command runs in it. A folder that cannot be written is one paragraph naming it."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.checkpoint.output_dir import LOCK_FILE, OutputFolder, check_output_dir
from megatrain.checkpoint.saving import checkpoint_run_id, list_checkpoints, save_checkpoint
from megatrain.cli import main
from megatrain.config import load_config, save_config
from megatrain.engine.engine import StreamingEngine
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.recipes.sft import Trainer
from megatrain.store.host import HostStore
from run_helpers import tiny_run_args

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
_args = tiny_run_args


def _train(out: Path, *overrides: str) -> Trainer:
    trainer = Trainer(load_config(DEMO, _args(out, *overrides)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def _train_steps(path: Path) -> list[int]:
    lines = path.read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_new_run_in_a_used_output_dir_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _train(tmp_path, "--training.max_steps", "2")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = main(["train", "--config", str(DEMO), *_args(tmp_path, "--training.max_steps", "1")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"training.output_dir='{tmp_path}' is not empty" in err
    assert "--checkpoint.resume_from auto" in err and "overwrite_output_dir" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_overwrite_moves_the_previous_run_aside(tmp_path: Path) -> None:
    _train(
        tmp_path,
        "--training.max_steps",
        "3",
        "--checkpoint.save_every",
        "1",
        "--checkpoint.keep_last",
        "2",
    )
    (tmp_path / "notes.txt").write_text("mine")
    old_ckpts = [p.name for p in list_checkpoints(tmp_path)]
    assert old_ckpts == ["step-00000002", "step-00000003"]
    _train(tmp_path, "--training.max_steps", "1", "--training.overwrite_output_dir", "true")
    (previous,) = tmp_path.glob("previous-*")
    assert [p.name for p in list_checkpoints(previous)] == old_ckpts
    assert _train_steps(previous / "metrics.jsonl") == [1, 2, 3]
    assert _train_steps(tmp_path / "metrics.jsonl") == [1]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _store() -> HostStore:
    model = load_causal_lm(
        None,
        model_type="llama",
        tiny=True,
        config_overrides={"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64},
    )
    return HostStore(discover(model), compute_dtype=torch.float32)


def test_pruning_keeps_other_runs_checkpoints(tmp_path: Path) -> None:
    store = _store()
    save_checkpoint(tmp_path, 120, store, {}, keep_last=1, run_id="older")
    old_bytes = (tmp_path / "checkpoints" / "step-00000120" / "trainer_state.json").read_bytes()
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, store, {}, keep_last=1, run_id="newer")
    # the older run's step-120 outranks the new steps by number, and still neither is deleted
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-00000030", "step-00000120"]
    assert [checkpoint_run_id(p) for p in list_checkpoints(tmp_path)] == ["newer", "older"]
    # a same-step save of another lineage moves the old checkpoint aside, never deletes it
    save_checkpoint(tmp_path, 120, store, {}, keep_last=1, run_id="newer")
    aside = tmp_path / "checkpoints" / "step-00000120.other-run-older"
    assert (aside / "trainer_state.json").read_bytes() == old_bytes
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000120"]
    assert checkpoint_run_id(tmp_path / "checkpoints" / "step-00000120") == "newer"


def test_resumed_run_inherits_the_lineage_and_prunes_its_own(tmp_path: Path) -> None:
    common = ("--checkpoint.save_every", "1", "--checkpoint.keep_last", "1")
    first = _train(tmp_path, "--training.max_steps", "2", *common)
    resumed = _train(
        tmp_path, "--training.max_steps", "4", "--checkpoint.resume_from", "auto", *common
    )
    assert resumed.run_id == first.run_id
    (last,) = list_checkpoints(tmp_path)
    assert last.name == "step-00000004" and checkpoint_run_id(last) == first.run_id


def test_used_folder_without_checkpoints_is_not_offered_for_resume(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    with pytest.raises(ValueError, match="no checkpoint to resume from: choose another") as e:
        check_output_dir(tmp_path, resume_from=None, overwrite=False, export_hf=True)
    assert "holds metrics.jsonl" in str(e.value)
    # a run may resume into it; an hf_model that is not an export is refused before training
    (tmp_path / "hf_model").mkdir()
    (tmp_path / "hf_model" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"the export folder .*hf_model is not empty"):
        check_output_dir(tmp_path, resume_from="auto", overwrite=False, export_hf=True)
    check_output_dir(tmp_path, resume_from="auto", overwrite=False, export_hf=False)


@pytest.mark.parametrize("existed", [False, True], ids=["new folder", "empty folder"])
def test_a_start_with_bad_data_leaves_the_folder_free(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], existed: bool
) -> None:
    out = tmp_path / "run"
    if existed:
        out.mkdir()
    typo = tmp_path / "trian.jsonl"
    bad = _args(out, "--training.max_steps", "1", "--data.dataset", str(typo))
    assert main(["train", "--config", str(DEMO), *bad]) == 2
    assert str(typo) in capsys.readouterr().err
    # nothing claimed: a folder the run created is gone, an existing one is as it was (empty)
    assert list(out.iterdir()) == [] if existed else not out.exists()
    assert main(["train", "--config", str(DEMO), *_args(out, "--training.max_steps", "1")]) == 0
    assert _train_steps(out / "metrics.jsonl") == [1]


def test_a_start_that_failed_after_its_claim_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA out of memory")

    tensorboard = ("--logging.report_to", "tensorboard")  # opened as training starts
    with monkeypatch.context() as m:
        m.setattr(StreamingEngine, "train_step", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            _train(tmp_path, "--training.max_steps", "1", *tensorboard)
    # a CUDA error outside the allocator: the step ran once more (its record in metrics.jsonl)
    # before the run stopped
    kept = [LOCK_FILE, "config.yaml", "metrics.jsonl", "tensorboard"]
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    _train(tmp_path, "--training.max_steps", "1", "--optimizer.learning_rate", "1e-3", *tensorboard)
    assert _train_steps(tmp_path / "metrics.jsonl") == [1]
    assert load_config(tmp_path / "config.yaml").optimizer.learning_rate == 1e-3
    # the failed start's TensorBoard events and its retry's record are kept aside, with its config
    (previous,) = tmp_path.glob("previous-*")
    assert sorted(p.name for p in previous.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "tensorboard",
    ]


def test_only_megatrains_own_config_counts_as_a_failed_start(tmp_path: Path) -> None:
    cfg = load_config(DEMO, _args(tmp_path, "--training.overwrite_output_dir", "true"))
    save_config(cfg, tmp_path / "config.yaml")  # what a start that failed after its claim leaves
    check_output_dir(tmp_path, resume_from=None, overwrite=False, export_hf=False)
    folder = OutputFolder(cfg)
    folder.claim()
    folder.release()
    # overwrite_output_dir replaced it rather than moving it into a previous-<time>/ folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "config.yaml"]
    (tmp_path / "config.yaml").write_text("training:\n  output_dir: .\n")  # the user's own
    with pytest.raises(ValueError, match=r"it holds config\.yaml\)"):
        check_output_dir(tmp_path, resume_from=None, overwrite=False, export_hf=False)


@pytest.mark.parametrize("existed", [False, True], ids=["new folder", "existing folder"])
def test_a_read_only_output_dir_is_one_paragraph(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    existed: bool,
) -> None:
    out = tmp_path / "run"
    if existed:
        out.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def read_only(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).startswith(str(out)):  # what the kernel says on a read-only mount
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", read_only(real_open))
    monkeypatch.setattr(os, "mkdir", read_only(real_mkdir))
    code = main(["train", "--config", str(DEMO), *_args(out, "--training.max_steps", "1")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"training.output_dir='{out}' cannot be written (Read-only file system: {out}" in err
    assert "--training.output_dir PATH" in err


def test_a_refused_start_leaves_the_folders_lock_file_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # a finished run's folder
    lock = tmp_path / LOCK_FILE
    lock.write_text('{"pid": 1, "host": "earlier-run"}\n')
    os.utime(lock, ns=(1_000_000_000, 2_000_000_000))
    cfg = load_config(DEMO, _args(tmp_path))
    with pytest.raises(ValueError, match=r"holds metrics\.jsonl"):
        OutputFolder(cfg)
    assert lock.read_text() == '{"pid": 1, "host": "earlier-run"}\n'
    assert lock.stat().st_mtime_ns == 2_000_000_000
