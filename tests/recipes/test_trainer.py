"""The trainer end to end on the CPU: resume is exact, saves are atomic. (The demo's loss falls
and its Hugging Face export loads and generates: tests/recipes/grpo/test_grpo_demo.py, on the
GRPO demo's warm start, the one demo run both check.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.checkpoint import saving as ckpt_mod
from megatrain.checkpoint.saving import latest_checkpoint, list_checkpoints
from megatrain.config import load_config
from megatrain.recipes.sft import Trainer
from run_helpers import FEW_SAMPLES, crash_during_step

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def _run(tmp: Path, *overrides: str) -> Trainer:
    cfg = load_config(
        DEMO,
        [
            "--training.output_dir",
            str(tmp),
            "--logging.progress_bar",
            "false",
            "--logging.report_to",
            "none",
            *FEW_SAMPLES,
            *overrides,
        ],
    )
    trainer = Trainer(cfg)
    return trainer


def _train(tmp: Path, *overrides: str) -> list[float]:
    trainer = _run(tmp, *overrides)
    try:
        return trainer.train().losses
    finally:
        trainer.close()


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_resume_gives_identical_losses(tmp_path: Path, compute_dtype: str) -> None:
    common = (  # 2 rows a step: CPU bf16 matmuls are slow without native bf16
        "--training.micro_batch_size",
        "2",
        "--training.max_steps",
        "6",
        "--model.compute_dtype",
        compute_dtype,
        "--checkpoint.save_every",
        "3",
        "--checkpoint.export_hf",
        "false",
        "--data.val_size",
        "0",
    )
    straight = _train(tmp_path / "a", *common)
    # the same run, killed during step 4 (after the step-3 checkpoint), then resumed
    crashed = _run(tmp_path / "b", *common)
    seen = crash_during_step(crashed, 4)
    resumed = _train(tmp_path / "b", *common, "--checkpoint.resume_from", "auto")
    assert len(straight) == 6 and len(seen) == 3 and len(resumed) == 3
    assert seen + resumed == straight


def test_crash_mid_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _run(
        tmp_path,
        "--training.max_steps",
        "2",
        "--checkpoint.export_hf",
        "false",
        "--checkpoint.keep_last",
        "3",
    )
    try:
        trainer.train()
        good = latest_checkpoint(tmp_path)
        assert good is not None and good.name == "step-00000002"
        before = {p.name: p.read_bytes() for p in (good / "blocks").iterdir()}
        calls = {"n": 0}
        real_save = ckpt_mod.save_file

        def crash_after_two(*args: object, **kwargs: object) -> None:
            calls["n"] += 1
            if calls["n"] > 2:
                raise OSError("disk full (simulated)")
            real_save(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(ckpt_mod, "save_file", crash_after_two)
        trainer.step = 3
        with pytest.raises(OSError, match="simulated"):
            trainer.save()
    finally:
        trainer.close()
    # the half-written checkpoint is not a checkpoint; the previous one is intact
    assert latest_checkpoint(tmp_path) == good
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002"]
    assert {p.name: p.read_bytes() for p in (good / "blocks").iterdir()} == before
    monkeypatch.undo()
    # the next save cleans the debris and succeeds
    trainer2 = _run(
        tmp_path,
        "--training.max_steps",
        "3",
        "--checkpoint.export_hf",
        "false",
        "--checkpoint.resume_from",
        "auto",
        "--checkpoint.keep_last",
        "3",
    )
    try:
        trainer2.train()
    finally:
        trainer2.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000003"]


def test_keep_last_prunes_old_checkpoints(tmp_path: Path) -> None:
    _train(
        tmp_path,
        "--training.max_steps",
        "4",
        "--checkpoint.save_every",
        "1",
        "--checkpoint.keep_last",
        "2",
        "--checkpoint.export_hf",
        "false",
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    saved = load_config(tmp_path / "checkpoints" / "step-00000004" / "config.yaml")
    assert saved.checkpoint.keep_last == 2


def test_resume_from_a_different_model_is_refused(tmp_path: Path) -> None:
    _train(tmp_path, "--training.max_steps", "1", "--checkpoint.export_hf", "false")
    with pytest.raises(ValueError, match="different parameters"):
        _run(
            tmp_path,
            "--checkpoint.resume_from",
            "auto",
            "--model.config_overrides",
            "{num_hidden_layers: 4, hidden_size: 64, "
            "intermediate_size: 128, vocab_size: 512, num_attention_heads: 4, "
            "num_key_value_heads: 2, head_dim: 16, tie_word_embeddings: true}",
        )
