"""`megatrain train` on a vision-language model, end to end on the CPU (examples/vlm_demo.yaml):
the demo learns, a trained vision tower resumes exactly, the export is the whole model (vision
weights as loaded when frozen, as trained when not), and the plan counts the vision modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.recipes.sft import Trainer
from run_helpers import crash_during_step

VLM_DEMO = Path(__file__).resolve().parents[2] / "examples" / "vlm_demo.yaml"


def _args(out: Path, *overrides: str) -> list[str]:
    return [
        "--training.output_dir", str(out), "--logging.progress_bar", "false",
        "--logging.report_to", "none", "--checkpoint.export_hf", "false", *overrides,
    ]  # fmt: skip


def _train_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] in ("train", "eval")]


def test_vlm_demo_learns_and_exports_the_whole_model(tmp_path: Path) -> None:
    args = _args(tmp_path, "--training.num_epochs", "3", "--checkpoint.export_hf", "true")
    assert main(["train", "--config", str(VLM_DEMO), *args]) == 0
    records = _train_records(tmp_path)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and evals[-1]["eval_loss"] < 0.5 * train[0]["loss"]
    with safe_open(str(tmp_path / "hf_model" / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # in the checkpoint layout of the hub (transformers converts)
    assert any(n.startswith("visual.") for n in names)  # frozen: exported as loaded
    assert any(n.startswith("model.layers.") for n in names)
    reloaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf_model"))
    assert type(reloaded).__name__ == "Qwen2_5_VLForConditionalGeneration"


def _trainer(out: Path, *overrides: str) -> Trainer:
    common = ("--model.freeze_vision", "false", "--model.freeze_projector", "false")
    return Trainer(load_config(VLM_DEMO, _args(out, *common, *overrides)))


def test_trained_vision_tower_resumes_exactly(tmp_path: Path) -> None:
    common = ("--training.max_steps", "6", "--checkpoint.save_every", "3")
    trainer = _trainer(tmp_path / "a", *common)
    try:
        straight = trainer.train().losses
        assert trainer.store.vision is not None
        trained = trainer.store.vision.master.clone()
    finally:
        trainer.close()
    seen = crash_during_step(_trainer(tmp_path / "b", *common), 4)
    trainer = _trainer(tmp_path / "b", *common, "--checkpoint.resume_from", "auto")
    try:
        resumed = trainer.train().losses
        assert trainer.store.vision is not None
        assert torch.equal(trainer.store.vision.master, trained)
    finally:
        trainer.close()
    assert len(straight) == 6 and seen + resumed == straight


def test_grpo_refuses_a_vision_language_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grpo_demo = VLM_DEMO.parent / "grpo_demo.yaml"
    vlm = ["--model.name_or_path", "null", "--model.model_type", "qwen2_5_vl"]
    vlm += ["--model.tiny", "true", "--model.tokenizer", "demo_vlm"]
    vlm += ["--model.config_overrides", "{vocab_size: 486}"]
    assert main(["grpo", "--config", str(grpo_demo), *vlm, *_args(tmp_path)]) == 2
    assert "vision-language model" in capsys.readouterr().err
