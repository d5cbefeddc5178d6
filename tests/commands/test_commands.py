"""Every command reads the run config through the same builder: verify and estimate take the
train config and its overrides, `python -m megatrain` is the CLI, and the short forms build the
same config as the YAML they abbreviate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.verify import make_batches, verify_config

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def test_python_dash_m_is_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "megatrain", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("megatrain ")
    helped = subprocess.run(
        [sys.executable, "-m", "megatrain", "verify", "--help"], capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--verify.steps" in helped.stdout


def test_verify_takes_the_train_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["verify", "--config", str(DEMO), "--verify.steps", "1"]
    argv += ["--training.micro_batch_size", "2", "--data.cutoff_len", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "1 micro-batches of 2x64 (packed)" in out


def test_estimate_takes_the_train_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--config", str(DEMO), "--json"]) == 0
    assert '"micro_batch_size": 8' in capsys.readouterr().out


def test_short_form_equals_the_yaml_it_abbreviates(tmp_path: Path) -> None:
    short = verify_config(model_type="qwen3", tiny=True, grad_accum=3, seq_len=32, packed=True)
    yaml = tmp_path / "v.yaml"
    yaml.write_text(
        "model: {model_type: qwen3, tiny: true, tokenizer: demo, compute_dtype: fp32}\n"
        "data: {cutoff_len: 32, packing: true}\n"
        "training: {micro_batch_size: 2, gradient_accumulation_steps: 3, seq_len: 32, seed: 0,\n"
        "           compile_layers: false}\n"
        "optimizer: {learning_rate: 1.0e-3, weight_decay: 0.1, lr_scheduler: constant}\n"
        "memory: {gpu_state_blocks: 0}\n"
    )
    assert short == load_config(yaml)


def test_derived_values_are_decided_once() -> None:
    cfg = load_config(DEMO, ["--optimizer.max_grad_norm", "0", "--training.seq_len", "512"])
    assert cfg.optimizer.clip_norm is None and cfg.seq_len == 512 and cfg.layout == "packed"
    cfg = load_config(DEMO)
    assert cfg.optimizer.clip_norm == 1.0 and cfg.seq_len == 256
    assert str(cfg.model.torch_dtype) == "torch.float32"


@pytest.mark.parametrize(
    ("flags", "layout", "masked", "positions"),
    [
        ([], "padded", True, False),
        (["--data.packing", "true"], "packed", False, True),
        (["--data.stage", "pt"], "full", False, False),
    ],
)
def test_verify_batches_come_in_the_runs_layout(
    flags: list[str], layout: str, masked: bool, positions: bool
) -> None:
    """verify checks the engine on rows like the run's: a pre-training config's are full
    rows (no mask, no restarting positions), not padded ones."""
    cfg = verify_config(None, flags, model_type="llama", tiny=True)
    assert cfg.layout == layout
    (batch,) = make_batches(cfg, 1, 64, 0, 2, 1)[0]
    assert (batch.attention_mask is not None) is masked
    assert (batch.position_ids is not None) is positions
