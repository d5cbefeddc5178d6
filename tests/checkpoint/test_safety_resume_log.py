"""Kill and resume: metrics.jsonl and TensorBoard continue the checkpoint's history with every
step exactly once, and Ctrl-C prints one line naming the last checkpoint and the resume key."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.engine.engine import StreamingEngine
from megatrain.metrics import truncate_metrics
from megatrain.recipes.base import Recipe
from megatrain.recipes.sft import Trainer
from run_helpers import FEW_SAMPLES

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
SMALL = (
    "{vocab_size: 512, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, tie_word_embeddings: true}"
)


def _args(out: Path, *overrides: str) -> list[str]:
    return [
        "--training.output_dir", str(out), "--logging.progress_bar", "false",
        "--model.config_overrides", SMALL, *FEW_SAMPLES, "--data.val_size", "0",
        "--training.micro_batch_size", "2", "--checkpoint.export_hf", "false",
        "--training.max_steps", "6", "--checkpoint.save_every", "3", *overrides,
    ]  # fmt: skip


def _interrupt_during_step(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real, done = StreamingEngine.train_step, []

    def step(self: StreamingEngine, *args: object, **kwargs: object) -> object:
        if len(done) == n - 1:
            raise KeyboardInterrupt
        done.append(1)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StreamingEngine, "train_step", step)


def test_resume_log_has_every_step_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    straight = Trainer(load_config(DEMO, _args(tmp_path / "a")))
    try:
        reference = straight.train().losses
    finally:
        straight.close()
    # killed during step 6 after logging 1-5; the checkpoint is step 3, so 4-5 are redone
    with monkeypatch.context() as m:
        _interrupt_during_step(6, m)
        killed = Trainer(load_config(DEMO, _args(tmp_path / "b")))
        with pytest.raises(KeyboardInterrupt, match="step-00000003"):
            killed.train()
        killed.close()
    log = tmp_path / "b" / "metrics.jsonl"
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    resumed = Trainer(load_config(DEMO, _args(tmp_path / "b", "--checkpoint.resume_from", "auto")))
    try:
        resumed.train()
    finally:
        resumed.close()
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == reference  # resume is exact, so the log is too
    tb_steps = _tensorboard_steps(tmp_path / "b" / "tensorboard", "train/loss")
    if tb_steps is not None:
        assert tb_steps == [1, 2, 3, 4, 5, 6]


def _tensorboard_steps(folder: Path, tag: str) -> list[int] | None:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_truncate_keeps_steps_up_to_the_checkpoint(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s}) for s in (1, 2, 3, 4)]
    lines.insert(2, json.dumps({"kind": "eval", "step": 2}))
    log.write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a line cut by a kill
    assert truncate_metrics(log, 2) == 3
    assert log.read_text().splitlines() == lines[:3]
    assert truncate_metrics(log, 2) == 0


def test_ctrl_c_prints_where_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _interrupt_during_step(5, monkeypatch)
    args = _args(tmp_path, "--logging.report_to", "none")
    assert main(["train", "--config", str(DEMO), *args]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = tmp_path / "checkpoints" / "step-00000003"
    assert f"interrupted at step 4; the last checkpoint is {last}" in err
    assert "--checkpoint.resume_from auto" in err


def test_ctrl_c_before_any_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _interrupt_during_step(2, monkeypatch)
    args = _args(tmp_path, "--logging.report_to", "none")
    assert main(["train", "--config", str(DEMO), *args]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no checkpoint was saved yet" in err


def test_done_line_says_where_a_resumed_run_started(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(tmp_path, "--logging.report_to", "none")
    assert main(["train", "--config", str(DEMO), *args, "--training.max_steps", "3"]) == 0
    assert main(["train", "--config", str(DEMO), *args, "--checkpoint.resume_from", "auto"]) == 0
    first, resumed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("done:")]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first.startswith(f"done: 3 steps, loss {losses[0]:.4f} -> {losses[2]:.4f};")
    assert resumed.startswith(
        f"done: 6 steps (resumed at step 3), loss {losses[3]:.4f} at step 4 -> {losses[5]:.4f};"
    )


def test_a_non_finite_loss_stops_with_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN loss at step 5 (after the checkpoint of step 3): exit code 1, no traceback, the
    settings to change and the checkpoint to resume from; nothing saved on the way out."""
    real, done = StreamingEngine.train_step, []

    def step(self: StreamingEngine, *args: object, **kwargs: object) -> object:
        result = real(self, *args, **kwargs)  # type: ignore[arg-type]
        done.append(1)
        return dataclasses.replace(result, loss=math.nan) if len(done) == 5 else result

    monkeypatch.setattr(StreamingEngine, "train_step", step)
    args = _args(tmp_path, "--logging.report_to", "none")
    assert main(["train", "--config", str(DEMO), *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = tmp_path / "checkpoints" / "step-00000003"
    assert "loss is nan at step 5: lower optimizer.learning_rate" in err
    assert f"The last checkpoint is {last}: resume with the same command" in err
    assert "gpu_update_blocks" not in err  # no share (and on the CPU it is never suspected)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]


def test_a_non_finite_loss_names_the_gpu_update_share_on_cuda(tmp_path: Path) -> None:
    """On CUDA with a share on, the paragraph names optimizer.gpu_update_blocks as the suspect
    (docs/optimizer_states.md, "The share's NaN"); without a checkpoint it says so."""
    engine = SimpleNamespace(
        transfers=SimpleNamespace(is_cuda=True), share=SimpleNamespace(blocks=[0, 1, 2])
    )
    recipe = SimpleNamespace(
        engine=engine, loss_name="loss", loss_fix="lower it", step=8, output_dir=tmp_path
    )
    text = Recipe._non_finite_message(recipe, math.inf)  # type: ignore[arg-type]
    assert text.startswith("loss is inf at step 8: lower it; the GPU update share was on ")
    assert "optimizer.gpu_update_blocks: 3 blocks" in text and "set it to 0" in text
    assert f". No checkpoint was saved yet in {tmp_path}" in text
